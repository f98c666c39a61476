"""Name the slow rank or node while it is slow (issue 32, item 2).

In synchronous data-parallel training every rank's step takes as long as the slowest one's: the others wait for it
inside collectives. So each rank measures, per optimizer step, its wall time and the part it spent blocked in
collectives; the rest is its own work ("busy"). A rank whose busy time is >= 1.5x the median of the other ranks' for
3 logging steps in a row is named, and so is a node whose ranks' median is >= 1.5x the other nodes' (a throttled or
shared host slows all its ranks, which then hide each other from a per-rank median).

Blocked time is the time the training thread slept in collectives waiting for the others (`StepClock`), where the
host blocks in them (gloo: CPU runs): torch.distributed's `Work.wait` (every Python-level collective, synchronous ones
included, goes through it: FSDP, DeepSpeed, accelerate, TRL), plus DDP's gradient all-reduce, which its C++ reducer
runs outside Python: a communication hook (torch's own default all-reduce hook, timed) gives the time from the last
bucket's launch to its completion, which the rank waits at the end of its backward. A wait's time running or waiting
for a CPU (Linux schedstat) is not sleep: a throttled rank stalls inside its waits too. On CUDA, NCCL collectives are
asynchronous for the host (its waits return at once, futures complete on enqueue), so nobody would be named: not
measured on GPUs yet (that needs NCCL's own timing), said once at the start.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

RATIO = 1.5  # busy time over the others' median that counts as slow
STREAK = 3  # logging steps in a row before a rank or node is named
WARMUP = 2  # logging steps of an attempt not judged: the first steps carry one-off work (DDP's bucket rebuild, the
# allocator's first requests, lazy initialisation) that falls unevenly on the ranks
CAUSES = (
    "the usual causes: CPU or GPU throttling (thermal, power, a CPU quota), a noisy neighbour on the host, a failing "
    "device; a slow link shows instead as every rank waiting longer"
)


def sched(tid: int | None = None) -> float:
    """Seconds a thread (this one by default) has run or waited runnable for a CPU (Linux schedstat: CPU time plus
    run delay, a CPU quota's throttled time included); 0 where the kernel does not say."""
    path = f"/proc/self/task/{tid}/schedstat" if tid else "/proc/thread-self/schedstat"
    try:
        with open(path) as fh:
            ran, delayed, _ = fh.read().split()
        return (int(ran) + int(delayed)) / 1e9
    except (OSError, ValueError):
        return 0.0


class StepClock:
    """This rank's busy and blocked time per optimizer step, since the last logging step.

    Blocked is the time the training thread slept in collectives waiting for the others: a wait's wall time minus the
    time the thread ran or waited for a CPU meanwhile (schedstat). A slow rank's own stalls (a CPU quota throttles it
    anywhere, inside its waits too) are then not taken for waiting on others; busy is the step's wall time minus it."""

    def __init__(self) -> None:
        self.main = threading.main_thread()
        self.in_step = False
        self.began = 0.0
        self.blocked = 0.0
        self.ddp_launched = (0.0, 0.0)  # DDP's last gradient bucket of this step: (time, sched) at launch, at the end
        self.ddp_done = (0.0, 0.0)
        self.steps: list[tuple[float, float]] = []  # (busy, blocked) per step

    def begin(self) -> None:
        self.in_step, self.began, self.blocked = True, time.monotonic(), 0.0
        self.ddp_launched = self.ddp_done = (0.0, 0.0)

    def end(self) -> None:
        if not self.in_step:
            return
        wall = time.monotonic() - self.began
        blocked = self.blocked
        (launched, ran_before), (done, ran_after) = self.ddp_launched, self.ddp_done
        if launched and done > launched:
            blocked += max(0.0, (done - launched) - (ran_after - ran_before))
        blocked = min(blocked, wall)
        self.steps.append((wall - blocked, blocked))
        self.in_step = False

    def waited(self, seconds: float, ran: float) -> None:
        """A wait of the training thread: `seconds` of wall time, `ran` of them running or runnable."""
        if self.in_step and threading.current_thread() is self.main:
            self.blocked += max(0.0, seconds - ran)

    def window(self) -> tuple[float, float]:
        """(mean busy, mean blocked) per step since the last call; (0, 0) when no step ended."""
        steps, self.steps = self.steps, []
        if not steps:
            return 0.0, 0.0
        return statistics.fmean(b for b, _ in steps), statistics.fmean(w for _, w in steps)


def measured(args) -> bool:
    """Whether this run's ranks measure their blocked time: several ranks, on CPUs (see the module's docstring)."""
    return args.world_size > 1 and args.device.type == "cpu"


_INSTALLED: list[StepClock] = []


def install(clock: StepClock) -> None:
    """Time every `Work.wait` of this process (once per process)."""
    work = torch.distributed.distributed_c10d.Work
    if _INSTALLED:
        _INSTALLED[0] = clock
        return
    _INSTALLED.append(clock)
    original = work.wait

    def wait(self, *args, **kwargs):
        began, ran = time.monotonic(), sched()
        try:
            return original(self, *args, **kwargs)
        finally:
            _INSTALLED[0].waited(time.monotonic() - began, sched() - ran)

    work.wait = wait


def time_ddp(model, clock: StepClock) -> bool:
    """Register torch's default all-reduce as DDP's communication hook, timed; False where the model is not DDP or
    already has a hook (accelerate's ddp_comm_hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False

    main = threading.main_thread().native_id

    def timed(state, bucket):
        clock.ddp_launched = (time.monotonic(), sched(main))
        future = default_hooks.allreduce_hook(state, bucket)

        def done(fut):  # on gloo's thread: the training thread's schedstat read from here
            clock.ddp_done = (time.monotonic(), sched(main))
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()

        return future.then(done)

    try:
        model.register_comm_hook(None, timed)
    except RuntimeError:  # a hook is there already: the user's choice stands, DDP's wait goes unmeasured
        return False
    return True


def gather(clock: StepClock, rank: int, world: int, node: int, dist, device) -> list[tuple[float, float, int]]:
    """Every rank's (busy, blocked, node) per step since the last logging step: one all-reduce, every rank calls it."""
    busy, blocked = clock.window()
    rows = torch.zeros((world, 3), dtype=torch.float64, device=device)
    rows[rank] = torch.tensor([busy, blocked, node], dtype=torch.float64, device=device)
    if dist is not None:
        dist.all_reduce(rows)
    return [(float(b), float(w), int(n)) for b, w, n in rows.tolist()]


def ratio(values: list[float], index: int) -> float:
    """values[index] over the median of the others (1.0 when there are no others or they did nothing)."""
    others = [v for i, v in enumerate(values) if i != index]
    middle = statistics.median(others) if others else 0.0
    return values[index] / middle if middle > 0 else 1.0


class Watch:
    """Rank 0's view over logging steps: the slowest rank and node, and who has been slow for STREAK logs in a row."""

    def __init__(self) -> None:
        self.streaks: dict[str, int] = {}  # logging steps in a row each suspect has been slow
        self.calm: dict[str, int] = {}  # the named ones: logging steps in a row back in line since
        self.named: list[str] = []  # the lines printed, in order (the report keeps them)
        self.slowest: dict = {}
        self.seen = 0  # logging steps seen (the first WARMUP are shown, not judged)

    def see(self, rows: list[tuple[float, float, int]], step: int) -> tuple[dict, list[str]]:
        """Figures for the log record and the lines to print now."""
        busy = [b for b, _, _ in rows]
        if len(rows) < 2 or not any(busy):
            return {}, []
        slow = max(range(len(rows)), key=lambda r: busy[r])
        figures = {"slowest_rank": slow, "slowest_node": rows[slow][2], "slowest_ratio": round(ratio(busy, slow), 3),
                   "wait_s": round(statistics.median(w for _, w, _ in rows), 4)}  # fmt: skip
        lines = []
        nodes = sorted({n for _, _, n in rows})
        suspects: list[tuple[str, float, str]] = []
        if len(nodes) > 1:
            node_busy = [statistics.median(b for b, _, n in rows if n == node) for node in nodes]
            for i, node in enumerate(nodes):
                ranks = [r for r, row in enumerate(rows) if row[2] == node]
                where = f"node {node} (rank{'s' if len(ranks) > 1 else ''} {_span(ranks)})"
                suspects.append((f"node {node}", ratio(node_busy, i), where))
        if not any(r >= RATIO for _, r, _ in suspects):  # no node stands out: a rank might, within its node
            for r in range(len(rows)):
                suspects.append((f"rank {r}", ratio(busy, r), f"rank {r} on node {rows[r][2]}"))
        self.seen += 1
        flagged = {key for key, r, _ in suspects if r >= RATIO and self.seen > WARMUP}
        for key in list(self.calm):  # a named rank or node is named again only after STREAK logs back in line
            self.calm[key] = 0 if key in flagged else self.calm[key] + 1
            if self.calm[key] >= STREAK:
                del self.calm[key]
        for key in list(self.streaks):
            if key not in flagged:
                del self.streaks[key]
        for key, r, where in suspects:
            if key not in flagged:
                continue
            self.streaks[key] = self.streaks.get(key, 0) + 1
            if self.streaks[key] >= STREAK and key not in self.calm:
                self.calm[key] = 0
                line = (f"[orch] straggler at step {step}: {where} takes {r:.1f}x the others' compute per step for "
                        f"{STREAK} logging steps; the others wait for it in collectives; {CAUSES}")  # fmt: skip
                lines.append(line)
                self.named.append(line)
        self.slowest = {**figures, "busy_s": round(busy[slow], 4)}
        return figures, lines

    def report(self) -> dict:
        return {**self.slowest, "named": self.named}


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else (
        ", ".join(map(str, ranks)))
