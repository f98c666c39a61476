"""The progress watchdog's rule, pure: given what the ranks of a node last reported (train/progress.py), has the node
stalled? Effects (reading the files, dumping stacks, ending the gang) live in node/supervise.py.

Progress is an optimizer step by any rank, or a heartbeat from a rank that saves, evaluates or writes the final
model (credited for ORCH_STALL_BUSY seconds at most, so a collective that hangs inside a save is still found, and
not at all once another node has been unreachable for PEER_LOST seconds: a heartbeat cannot hide a dead network).
  - before the first step (model download, load, compile): a stall after ORCH_STALL_FIRST seconds (default 1800);
  - after it: when no rank progressed for max(10 x the median step time, ORCH_STALL_FLOOR) seconds (default floor
    300 s: above a slow step or a long evaluation between steps, below the process group's own timeouts, 600 s
    for NCCL and TRL's ddp_timeout of 1800 s, so the watchdog speaks first and says where every rank waits).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.core.errors import EXIT_RETRYABLE
from orchestrator.core.knobs import knob

DEFAULT_FLOOR = 300.0
DEFAULT_FIRST = 1800.0
DEFAULT_BUSY = 3600.0
STEP_FACTOR = 10
PEER_LOST = 60.0
"""Seconds another node may stay unreachable while this one saves before the save's heartbeat stops counting."""
BUSY_PHASES = ("save", "eval", "final")  # train/progress.py's, which the launch side may not import
EXIT_STALLED = EXIT_RETRYABLE  # 75, EX_TEMPFAIL: a retryable failure (a managed job restarts on it)


@dataclass
class Bounds:
    floor: float = DEFAULT_FLOOR
    first: float = DEFAULT_FIRST
    busy: float = DEFAULT_BUSY
    on: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Bounds:
        return cls(
            floor=knob(env, "ORCH_STALL_FLOOR", DEFAULT_FLOOR),
            first=knob(env, "ORCH_STALL_FIRST", DEFAULT_FIRST),
            busy=knob(env, "ORCH_STALL_BUSY", DEFAULT_BUSY),
            on=knob(env, "ORCH_WATCHDOG", "on") == "on",
        )


@dataclass
class Watchdog:
    bounds: Bounds
    started: float
    last_step: int = -1
    last_progress: float = 0.0
    step_times: list[float] = field(default_factory=list)
    busy_since: dict[int, float] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # the peers found unreachable at the last probe
    lost_since: float | None = None

    def peers(self, unreachable: list[str], now: float) -> None:
        """What the last probe of the other nodes found (node/supervise.Peers), while a rank is busy."""
        self.lost = unreachable
        if not unreachable:
            self.lost_since = None
        elif self.lost_since is None:
            self.lost_since = now

    def busy(self, ranks: Mapping[int, Mapping]) -> bool:
        return any(r.get("phase") in BUSY_PHASES for r in ranks.values())

    def bound(self) -> float:
        if self.last_step < 0:
            return self.bounds.first
        if len(self.step_times) < 2:
            return self.bounds.floor
        intervals = [b - a for a, b in zip(self.step_times, self.step_times[1:], strict=False)]
        return max(STEP_FACTOR * statistics.median(intervals), self.bounds.floor)

    def observe(self, ranks: Mapping[int, Mapping], now: float) -> str:
        """Feed the ranks' latest records; return why the node stalled, or "" while it progresses."""
        if not self.bounds.on:
            return ""
        steps = [int(r.get("step", 0)) for r in ranks.values()]
        if ranks and max(steps) > self.last_step and max(steps) > 0:
            self.last_step = max(steps)
            self.last_progress = now
            self.step_times = (self.step_times + [now])[-50:]
        lost_for = now - self.lost_since if self.lost_since is not None else 0.0
        cut = lost_for > PEER_LOST
        for rank, record in ranks.items():
            if record.get("phase") in BUSY_PHASES:
                since = self.busy_since.setdefault(rank, float(record.get("t", now)))
                beat = float(record.get("t", 0.0))
                if cut:
                    return (f"rank {rank} has been in {record.get('phase')} for {now - since:.0f} s while "
                            f"{'; '.join(self.lost)} for {lost_for:.0f} s (a dead network: its "
                            "heartbeat no longer counts)")  # fmt: skip
                if beat > self.last_progress and beat - since <= self.bounds.busy:
                    self.last_progress = beat
            else:
                self.busy_since.pop(rank, None)
        bound = self.bound()
        if self.last_step < 0:
            waited = now - self.started
            if waited > bound:
                return f"no rank reached its first step within {waited:.0f} s (ORCH_STALL_FIRST={bound:g})"
            return ""
        idle = now - self.last_progress
        if idle > bound:
            how = (
                f"ORCH_STALL_FLOOR={self.bounds.floor:g}"
                if bound == self.bounds.floor
                else f"{STEP_FACTOR} x the median step time"
            )
            return f"no rank progressed for {idle:.0f} s after step {self.last_step} (bound {bound:.0f} s: {how})"
        return ""


def hang_tools(env: Mapping[str, str], gpus: bool, trace_prefix: str) -> dict[str, str]:
    """The owners' own hang tools for NCCL, where the user set nothing: PyTorch's flight recorder (the last
    collectives of every rank, dumped when NCCL's watchdog times out) and its dump on timeout."""
    if not gpus:
        return {}
    wanted = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": trace_prefix,
        "TORCH_NCCL_ENABLE_MONITORING": "1",
    }
    return {k: v for k, v in wanted.items() if k not in env}
