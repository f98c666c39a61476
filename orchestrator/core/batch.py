"""Global batch invariance: the GPU count changes the speed of a run, never its math.

samples per optimizer step = per_device_train_batch_size x data_parallel_size x gradient_accumulation_steps
A recipe fixes the left side (GLOBAL_BATCH_SIZE); orch solves for gradient_accumulation_steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.core.errors import OrchError

if TYPE_CHECKING:
    from orchestrator.core.parallel import Sizes
    from orchestrator.core.trainers import TrainerSpec

TRAINING_ARGS_DEFAULT_PER_DEVICE = 8  # transformers.TrainingArguments.per_device_train_batch_size


def positive_int(value: object, name: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise OrchError(f"{name}={value!r} is not a whole number") from None
    if number < 1:
        raise OrchError(f"{name}={number} must be at least 1")
    return number


def per_device_batch(settings: Mapping) -> int:
    """settings: the effective TRL settings (config file, then key=value overrides)."""
    raw = settings.get("per_device_train_batch_size")
    return positive_int(raw if raw is not None else TRAINING_ARGS_DEFAULT_PER_DEVICE, "per_device_train_batch_size")


def global_batch_of(env: Mapping[str, str]) -> int | None:
    """GLOBAL_BATCH_SIZE of a recipe's env, or None when it declares none."""
    raw = env.get("GLOBAL_BATCH_SIZE", "").strip()
    return positive_int(raw, "GLOBAL_BATCH_SIZE") if raw else None


SEARCH = 4096
"""The largest per-device batch or rank count `solve` tries when it suggests one."""


def solve(global_batch: int, per_device: int, data_parallel_size: int, per_node: int = 0,
          data_parallel_of: Callable[[int], int] = lambda total: total, least: int = 1, multiple: int = 1) -> int:
    """gradient_accumulation_steps that keeps `global_batch`, or an error naming the nearest valid choices; with
    `per_node` (processes per node), also the node counts that keep it, whose data-parallel ranks `data_parallel_of`
    gives for a number of processes (a resume may change the shape). The choices are ones the trainer takes: no
    per-device batch below `least`, global batches that are multiples of `multiple` (num_generations)."""
    per_step = per_device * data_parallel_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    fixes = []
    # the searches are bounded: a per-device batch or a rank count out of any real range (a typo, a fuzzer) must
    # not turn an error message into minutes of work
    devices = [d for d in range(min(per_device - 1, SEARCH), least - 1, -1)
               if global_batch % (d * data_parallel_size) == 0]  # fmt: skip
    if devices:
        fixes.append(f"per_device_train_batch_size={devices[0]}")
    fixes.append(" or ".join(f"GLOBAL_BATCH_SIZE={g}" for g in nearest(global_batch, math.lcm(per_step, multiple))))
    ranks = [r for r in range(min(data_parallel_size - 1, SEARCH), 0, -1) if global_batch % (per_device * r) == 0]
    if ranks:
        fixes.append(f"{ranks[0]} data-parallel ranks")
    keep = nodes_that_keep(global_batch, per_device, per_node, data_parallel_of) if per_node else []
    named = f"{say_nodes(keep)} node(s) x {per_node} (--nodes)" if keep else ""
    shapes = f"; at this per-device batch these shapes keep it: {named}" if named else ""
    raise OrchError(
        f"GLOBAL_BATCH_SIZE={global_batch} is not a multiple of per_device_train_batch_size x data-parallel ranks "
        f"= {per_device} x {data_parallel_size} = {per_step}; use " + ", or ".join(fixes) + shapes
    )


def nearest(global_batch: int, step: int) -> list[int]:
    """The positive multiples of `step` just below and just above `global_batch`."""
    lower = global_batch // step * step
    return [g for g in (lower, lower + step) if g > 0]


def nodes_that_keep(global_batch: int, per_device: int, per_node: int, data_parallel_of: Callable[[int], int],
                    most: int = 64) -> list[int]:  # fmt: skip
    """Node counts (of `per_node` processes each) whose data-parallel ranks keep `global_batch` at this per-device
    batch: where a run can resume at another shape without changing its math. A count whose processes the context-,
    sequence- and tensor-parallel groups do not divide (data_parallel_of gives 0) is none of them."""
    ranks = {n: data_parallel_of(n * per_node) for n in range(1, most + 1)}
    return [n for n, dp in ranks.items() if dp > 0 and global_batch % (per_device * dp) == 0]


def say_nodes(nodes: list[int]) -> str:
    shown = [str(n) for n in nodes]
    if len(shown) > 6:
        return ", ".join(shown[:6]) + ", ..."
    return f"{', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else shown[0]


def accumulation_steps(
    global_batch: int | None, settings: Mapping, data_parallel_size: int, overridden: Iterable[str] = (),
    per_node: int = 0, data_parallel_of: Callable[[int], int] = lambda total: total, least: int = 1, multiple: int = 1,
) -> int | None:  # fmt: skip
    """None when the recipe declares no GLOBAL_BATCH_SIZE (then the TRL config's own value stands).

    overridden: the keys given as key=value overrides (accumulation cannot be both derived and given); per_node,
    data_parallel_of, least and multiple: see `solve`."""
    if global_batch is None:
        return None
    if "gradient_accumulation_steps" in overridden:
        raise OrchError(
            "gradient_accumulation_steps is derived from GLOBAL_BATCH_SIZE; "
            "override GLOBAL_BATCH_SIZE (--env GLOBAL_BATCH_SIZE=N) instead"
        )
    return solve(global_batch, per_device_batch(settings), data_parallel_size, per_node, data_parallel_of, least,
                 multiple)  # fmt: skip


def steps_of(settings: Mapping, global_batch: int | None, data_parallel: int) -> int:
    """The accumulation a run steps with: the one GLOBAL_BATCH_SIZE derives (`accumulation_steps`), else the settings'
    gradient_accumulation_steps (transformers' 1); an OrchError where neither is whole."""
    derived = accumulation_steps(global_batch, settings, data_parallel)
    return derived if derived is not None else positive_int(settings.get("gradient_accumulation_steps") or 1,
                                                            "gradient_accumulation_steps")  # fmt: skip


def generations(settings: Mapping, default: int) -> int:
    return positive_int(settings.get("num_generations", default), "num_generations")


def check_generations(global_batch: int | None, settings: Mapping, trainer: str, default: int,
                      per_step: int = 1) -> None:  # fmt: skip
    """A generating trainer (GRPO, RLOO): every optimizer step must hold whole groups of num_generations completions
    of one prompt (default: TRL's num_generations for that trainer). The choices offered are also multiples of
    `per_step` (per-device batch x data-parallel ranks), so that the accumulation comes out whole."""
    if global_batch is None:
        return
    group = generations(settings, default)
    if global_batch % group:
        choices = " or ".join(str(g) for g in nearest(global_batch, math.lcm(group, per_step)))
        raise OrchError(
            f"{trainer.upper()}: GLOBAL_BATCH_SIZE={global_batch} completions is not a multiple of num_generations="
            f"{group}; use GLOBAL_BATCH_SIZE={choices}"
        )


def check_eval_generations(settings: Mapping, trainer: str, default: int, processes: int) -> None:
    """A generating trainer (GRPO, RLOO) that evaluates: its eval batch over the `processes` must hold whole groups of
    num_generations_eval completions (default: num_generations), TRL's rule (GRPOConfig.__post_init__), which a rank
    would raise at its start."""
    from orchestrator.core.overrides import eval_strategy

    if eval_strategy(settings.get("eval_strategy")) is None:
        return
    group = positive_int(settings.get("num_generations_eval") or generations(settings, default), "num_generations_eval")
    per_device = positive_int(settings.get("per_device_eval_batch_size", 8), "per_device_eval_batch_size")
    if per_device * processes % group:
        choices = " or ".join(str(b) for b in nearest(per_device, group // math.gcd(group, processes)))
        raise OrchError(
            f"{trainer.upper()}: per_device_eval_batch_size={per_device} x {processes} processes is not a whole number "
            f"of groups of num_generations_eval={group} (TRL's rule for its evaluation); use "
            f"per_device_eval_batch_size={choices}"
        )


@dataclass(frozen=True)
class Smaller:
    """A per-device batch below the run's that keeps its math: the samples of an optimizer step, and a GRPO/RLOO
    generation batch, stay what they were; `overrides` are every setting that changes with it."""

    batch: int
    overrides: tuple[tuple[str, str], ...]
    kept: str
    """How the math is kept, in words (generation_memory.fewer: how the generation is split instead)."""

    def words(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.overrides)


def data_parallel_of(processes: int, sizes: Sizes | None) -> int:
    """The data-parallel ranks of `processes` training processes over `sizes`' context-, sequence- and tensor-parallel
    groups (all of them without), at least 1."""
    return max(1, processes // (sizes.model_parallel if sizes else 1))


def smaller(settings: Mapping, global_batch: int | None, processes: int, sizes: Sizes | None = None,
            spec: TrainerSpec | None = None) -> tuple[Smaller, ...]:  # fmt: skip
    """Every per-device batch below the settings' one that keeps a rank's samples an optimizer step (per-device batch
    x accumulation) whole, largest first, for `processes` training processes (data-parallel over `sizes`' context-,
    sequence- and tensor-parallel groups): under GLOBAL_BATCH_SIZE the node derives the accumulation (`solve`), else
    gradient_accumulation_steps grows to match. None below the trainer's least per-device batch (`spec`); a
    generating trainer keeps its generation batch too: TRL's generation_batch_size must stay a multiple of the
    per-device batch x `processes`, and an explicit steps_per_generation grows to match. Empty where the settings are
    not whole numbers or the global batch does not divide (the batch checks say so first)."""
    data_parallel = data_parallel_of(processes, sizes)
    least, generates = (spec.min_micro_batch, spec.generates) if spec else (1, False)
    try:
        per_device, steps = per_device_batch(settings), steps_of(settings, global_batch, data_parallel)
        every, spg = (
            (positive_int(settings[key], key) if generates and settings.get(key) not in (None, "") else None)
            for key in ("generation_batch_size", "steps_per_generation")
        )
    except OrchError:
        return ()
    samples = per_device * steps  # a rank's samples an optimizer step
    found = []
    for b in range(min(per_device - 1, SEARCH), max(least, 1) - 1, -1):
        if samples % b or every and every % (b * processes) or spg and spg * per_device % b:
            continue
        overrides = [("per_device_train_batch_size", str(b))]
        if not global_batch:
            overrides.append(("gradient_accumulation_steps", str(samples // b)))
        if spg:
            overrides.append(("steps_per_generation", str(spg * per_device // b)))
        kept = (f"GLOBAL_BATCH_SIZE={global_batch} kept: {samples // b} accumulation steps" if global_batch else
                f"the same {samples * data_parallel} samples a step")  # fmt: skip
        found.append(Smaller(b, tuple(overrides), kept))
    return tuple(found)


def first_fitting(choices: Iterable[Smaller], need: Callable[[Smaller], float],
                  usable: float) -> tuple[Smaller, float] | None:  # fmt: skip
    """The first of `choices` (largest first: `smaller`, generation_memory.fewer) whose `need` in GiB is at most
    `usable`, with that need; None where none is."""
    for choice in choices:
        if (gib := need(choice)) <= usable:
            return choice, gib
    return None
