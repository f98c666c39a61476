"""Where runs run: one backend per platform, registered by name.

A backend launches what `orch run` resolved and answers for the runs it recorded: their state, progress and logs,
cancel and down, and a directory here holding part of their output (the final model, the Trackio curves). The
commands are views over this interface: they pick a backend by the platform a run was launched on (`--local`: `local`,
else `sky`; a record says its own) and never branch on the kind of run. A new platform is a module with a class that
implements `Backend`, added to PLATFORMS (or `register`ed by a plugin); its module is imported only when used.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrator.core.errors import OrchError

if TYPE_CHECKING:
    import argparse

    from orchestrator.launch.recipe import Recipe
    from orchestrator.launch.records import Record

PLATFORMS: dict[str, str] = {
    "local": "orchestrator.launch.backends.local_backend:LocalBackend",
    "sky": "orchestrator.launch.backends.sky_backend:SkyBackend",
}
"""Platform name -> "module:class" of its backend."""


@dataclass(frozen=True)
class LocalOptions:
    """`orch run --local`'s own flags (local_backend.py)."""

    smoke: bool = False  # --smoke: the tiny model of the recipe's family and synthetic data, 8 steps.
    fresh: bool = False  # --fresh: delete this run's checkpoints first (only what orch made: core/owned.py)
    netns: bool = False  # --netns: each emulated node in a network namespace of its own (root).
    auto_fit: bool = False  # --auto-fit: on out of memory, retry once with half the batch, twice the accumulation;
    # on a cluster, a memory refusal before launch applies its smaller per-device batch (core/errors.DoesNotFit)


@dataclass(frozen=True)
class SkyOptions:
    """`orch run`'s SkyPilot flags (sky_backend.py, launch/placement.py)."""

    managed: bool = False  # --managed: a managed job (recovered after preemption) instead of a cluster job.
    spot: bool = False  # --spot: resources.use_spot.
    infra: str | None = None  # --infra: resources.infra (aws/us-east-1, k8s/<context>, slurm/<cluster>...)
    network_tier: str | None = None  # --network-tier: resources.network_tier (best: InfiniBand/EFA)
    image_id: str | None = None  # --image-id: resources.image_id.
    disk_size: int | None = None  # --disk-size: resources.disk_size, GB (core/disk_need.py checks it).
    max_restarts: int = 3  # --max-restarts: a managed job's restarts on exit 75 (placement.DEFAULT_RESTARTS)
    cluster: str | None = None  # --cluster: the cluster's name (default: the run's).
    idle_minutes: int | None = None  # --idle-minutes: autostop after M idle minutes (placement.DEFAULT_IDLE_MINUTES)
    down: bool = False  # --down: tear the cluster down when the job ends.
    keep_up: bool = False  # --keep-up: no autostop.
    detach: bool = False  # --detach: return once submitted.
    yes: bool = False  # -y: launch without showing the plan and asking.
    dry_run: bool = False  # --dry-run: show the task, every rank's command, the plan; launch nothing
    skip_optimizer: bool = False  # --skip-optimizer: with --dry-run, no optimizer.
    no_rehearsal: bool = False  # --no-rehearsal: the head node rehearses in its setup, not the laptop.


@dataclass(frozen=True)
class RunOptions:
    """`orch run`'s flags as the backends read them (argparse's names; each backend refuses the other's)."""

    argv: tuple[str, ...] = ()
    gpus: str | None = None
    nodes: int | None = None
    local: LocalOptions = LocalOptions()
    sky: SkyOptions = SkyOptions()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        given = vars(args)

        def part(kind: type) -> dict:
            return {f.name: given[f.name] for f in dataclasses.fields(kind) if f.name in given}

        return cls(tuple(given.get("argv") or ()), given.get("gpus"), given.get("nodes"), LocalOptions(**part(
            LocalOptions)), SkyOptions(**part(SkyOptions)))  # fmt: skip


@dataclass
class RunRequest:
    """What `orch run` hands a backend: the recipe and the user's parsed words, before resolution (each platform
    resolves its own accelerators: CPU processes here, GPUs on a cloud)."""

    recipe: Recipe
    options: RunOptions
    envs: dict[str, str] = field(default_factory=dict)  # --env and the flags that set knobs
    overrides: dict[str, str] = field(default_factory=dict)  # key=value words for TRL
    secrets: dict[str, str] = field(default_factory=dict)  # values: never written anywhere
    data: str | None = None  # --data FILE


class Backend(Protocol):
    """A platform's launcher and its answers for the runs it recorded (launch/records.py)."""

    name: str

    def run(self, request: RunRequest) -> int:
        """Resolve, check, record and launch; the exit code of the run (or of following it)."""
        ...

    def state(self, record: Record, refresh: bool) -> str:
        """The run's state as `orch status` shows it, written back to the record when it changed; `refresh` asks the
        live source even for a run the record says is over, and refreshes its progress too."""
        ...

    def progress(self, record: Record) -> dict[str, str]:
        """The run's last step, loss, trainer's metric, tokens/s, ETA and spend (launch/progress.KEYS), as known."""
        ...

    def logs(self, record: Record, follow: bool) -> int:
        ...

    def cancel(self, record: Record) -> str:
        """Stop the run's job; the line to print."""
        ...

    def down(self, record: Record) -> str:
        """Stop the run and free what it holds (a cluster); the line to print."""
        ...

    def output(self, record: Record, part: str, dest: Path, otherwise: str) -> Path:
        """A directory here that holds `part` of the run's output dir: "final" (the final model's top-level files) or
        "trackio" (the nodes' curves under trackio/). The run's own output dir when it is on this machine, else a copy
        fetched into `dest`; `otherwise` is what the user can do instead when it cannot be fetched."""
        ...


_loaded: dict[str, Backend] = {}


def register(name: str, target: str) -> None:
    """Add a platform: `target` is "module:class" of a class implementing Backend."""
    PLATFORMS[name] = target
    _loaded.pop(name, None)


def get(name: str) -> Backend:
    if name not in PLATFORMS:
        raise OrchError(f"no backend for platform {name!r}: orch knows {', '.join(sorted(PLATFORMS))}")
    if name not in _loaded:
        module, _, cls = PLATFORMS[name].partition(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def node_prices(per_node: int) -> dict[str, tuple[float, str]]:
    """The cheapest $/h of a node with `per_node` of each accelerator, from every platform that has a price catalog on
    this machine (an optional `node_prices` method: clouds have one, this machine does not)."""
    out: dict[str, tuple[float, str]] = {}
    for name in PLATFORMS:
        catalog = getattr(get(name), "node_prices", None)
        for accelerator, offer in (catalog(per_node) if catalog else {}).items():
            if accelerator not in out or offer[0] < out[accelerator][0]:
                out[accelerator] = offer
    return out


def for_record(record: Record) -> Backend:
    """The backend that answers for a recorded run."""
    return get(record.platform)
