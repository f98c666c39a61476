"""Parallelism refit: fit a recipe's context / sequence / tensor parallel sizes to the real world size.

dp_replicate x dp_shard x cp x sp x tp must equal the total process count. The recipe's cp, sp, tp and
dp_replicate are kept; dp_shard absorbs the rest. The data-parallel size, which multiplies the batch, is
total / (cp x sp x tp): ranks of one cp/sp/tp group see the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from orchestrator.core.errors import OrchError

KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


class Sizes(NamedTuple):
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1

    @property
    def model_parallel(self) -> int:
        """Ranks that share one stream of samples (cp x sp x tp)."""
        return self.cp * self.sp * self.tp

    def data_parallel(self, total: int) -> int:
        return total // self.model_parallel

    @property
    def pad_multiple(self) -> int | None:
        """What TRL's pad_to_multiple_of must be a multiple of: 2 x cp (ring attention) or sp (Ulysses)."""
        if self.cp > 1:
            return 2 * self.cp
        if self.sp > 1:
            return self.sp
        return None

    def flags(self) -> list[str]:
        return [x for key in KEYS for x in (f"--parallelism_config_{key}_size", str(getattr(self, key)))]


def ranks_of(sizes: Sizes | None) -> Callable[[int], int]:
    """The data-parallel ranks of a number of processes under `sizes` (all of them without), 0 where the model-
    parallel groups do not divide them (no such shape)."""
    mp = sizes.model_parallel if sizes is not None else 1
    return lambda total: total // mp if total % mp == 0 else 0


def declared(accelerate_config: Mapping) -> Sizes | None:
    """The sizes an Accelerate config's parallelism_config asks for, or None when it has none."""
    block = accelerate_config.get("parallelism_config") or {}
    if not block:
        return None
    values = {}
    for key in KEYS:
        raw = block.get(f"parallelism_config_{key}_size", 1)
        try:
            values[key] = int(raw)
        except (TypeError, ValueError):
            raise OrchError(
                f"parallelism_config_{key}_size={raw!r} in the Accelerate config is not a whole number"
            ) from None
        if values[key] < 1:
            raise OrchError(f"parallelism_config_{key}_size={values[key]} in the Accelerate config must be at least 1")
    return Sizes(**values)


def check_backend(sizes: Sizes, config) -> None:
    """Context parallelism needs FSDP2; ALST/Ulysses needs DeepSpeed ZeRO-3 (TRL's requirements). config: a parsed
    core.accelerate_config.AccelerateConfig."""
    if sizes.cp > 1 and sizes.sp > 1:
        raise OrchError("the Accelerate config sets both cp_size and sp_size; use ring attention (cp) or Ulysses (sp)")
    if sizes.cp > 1:
        if not config.fsdp or config.fsdp_version != 2:
            raise OrchError(
                f"context parallelism (cp_size={sizes.cp}) needs FSDP2: set distributed_type: FSDP and "
                "fsdp_config.fsdp_version: 2 in the Accelerate config"
            )
    if sizes.sp > 1:
        if not config.deepspeed or config.zero_stage != 3:
            raise OrchError(
                f"ALST/Ulysses sequence parallelism (sp_size={sizes.sp}) needs DeepSpeed ZeRO-3: set "
                "distributed_type: DEEPSPEED and deepspeed_config.zero_stage: 3 in the Accelerate config"
            )


def refit(sizes: Sizes, total: int) -> Sizes:
    """Keep cp, sp, tp and dp_replicate; dp_shard takes whatever is left of `total` processes."""
    fixed = sizes.dp_replicate * sizes.cp * sizes.sp * sizes.tp
    if total % fixed:
        multiples = ", ".join(str(fixed * k) for k in range(1, 5))
        raise OrchError(
            f"{total} processes cannot be split into dp_replicate {sizes.dp_replicate} x cp {sizes.cp} x "
            f"sp {sizes.sp} x tp {sizes.tp} = {fixed}; use a total GPU count that is a multiple of {fixed} "
            f"({multiples}, ...) or change those sizes in the Accelerate config"
        )
    return Sizes(sizes.dp_replicate, total // fixed, sizes.tp, sizes.cp, sizes.sp)


def pad_to_multiple_of(sizes: Sizes, settings: Mapping) -> str | None:
    """The pad_to_multiple_of TRL must get, or None when the effective TRL settings' own value already fits."""
    need = sizes.pad_multiple
    if need is None:
        return None
    given = settings.get("pad_to_multiple_of")
    if given in (None, "", "None", "null", "auto"):
        return str(need)
    try:
        value = int(str(given))
    except ValueError:
        raise OrchError(f"pad_to_multiple_of={given!r} is not a whole number") from None
    if value % need:
        what = f"2 x cp_size = {need}" if sizes.cp > 1 else f"sp_size = {need}"
        raise OrchError(f"pad_to_multiple_of={value} must be a multiple of {what}; drop it and orch sets {need}")
    return None
