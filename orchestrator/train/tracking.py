"""Curves in Trackio (`orch run --track`, ORCH_TRACK=<project>), written by every node, not only rank 0.

transformers' Trackio callback logs from world rank 0 only, and one SQLite file written by several nodes over a
bucket mount would be corrupted. So each node's first process writes its own local database
($ORCH_HOME/trackio/<run>/<project>.db, Trackio's own format through its storage layer), in the Trackio run named
after the orch run (ORCH_RUN_ID, else SKYPILOT_TASK_ID: stable across relaunches and recoveries):
  - node 0: the step record orch logs (loss, learning rate, grad norm, tok/s, MFU, ETA, dollars);
  - every node: `node<N>/tokens_per_s` and, on GPUs, `node<N>/gpu_mem_gb` (the most any of its ranks allocated)
    and `node<N>/gpu_util` (when NVML answers).
At each checkpoint the node copies its database into the checkpoint (`checkpoint-S/trackio/node<N>/`) and next to
the checkpoints (`<output_dir>/trackio/node<N>/`, refreshed at every save and when training ends, failed or not: a
failed run's curves up to its failure, as a local run's node home goes with it); both are written before
the save's barrier, so the manifests (written after it) list them whole. A resumed run starts from the copy in the
checkpoint it resumes from, so its curves continue where that checkpoint left them, without the steps it redoes.
`orch dashboard RUN` merges the nodes' copies (core/trackio_files.merge) and opens Trackio's dashboard on the result.

We write through trackio.sqlite_storage.SQLiteStorage.bulk_log, not trackio.init/log: init's background sender
thread gives no public flush, and a checkpoint's copy must hold every row up to its step.

Tracking never stops training: a failure to open, write or copy a node's database (a corrupt file, a full disk,
a Trackio error) prints one warning on that node and turns its tracking off; the collectives go on unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from orchestrator.core import owned
from orchestrator.core.home import orch_home
from orchestrator.core.knobs import knob
from orchestrator.core.trackio_files import backup as _backup
from orchestrator.core.trackio_files import node_copy


def project_of(env=os.environ) -> str:
    """The Trackio project when tracking is on (ORCH_TRACK: a project name; `off` or unset: no tracking)."""
    value = knob(env, "ORCH_TRACK", "off")
    return "" if value.lower() == "off" else value


class NodeTracker:
    """One per training process; only each node's first process (local rank 0) writes."""

    def __init__(self, project: str, run: str, node: int, nodes: int, local_main: bool, env=os.environ):
        self.project, self.run, self.node, self.nodes = project, run, node, nodes
        self.local_main = local_main
        self.dir = orch_home(env) / "trackio" / owned.check_name(run, "run id")
        self.storage = None
        self.last = None  # (time, this node's tokens) at the previous log
        self.off = ""  # why this node's tracking stopped ('' while it tracks)

    def _failed(self, what: str, exc: BaseException) -> None:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        self.off = f"{what}: {type(exc).__name__}: {reason}"
        print(f"[orch] warning: tracking off on node {self.node} ({self.off}); training goes on", flush=True)

    def start(self, output_dir: Path, resume: Path | None) -> None:
        """Open this node's database: the resumed checkpoint's copy when there is one, else an empty one."""
        if not self.local_main:
            return
        try:
            self._start(resume)
        except Exception as exc:  # noqa: BLE001 - tracking never stops training
            self._failed("opening its Trackio database", exc)

    def _start(self, resume: Path | None) -> None:
        why = owned.why_not_removable(self.dir, self.run)  # a directory orch made for this run, or none
        if why:  # not orch's to empty: a database of its own beside it
            self.dir = self.dir.with_name(f"{self.run}.{os.getpid()}")
            print(f"[orch] note: {why}; this node's live Trackio database goes to {self.dir} instead", flush=True)
        owned.remove(self.dir, self.run, "this node's live Trackio database")
        owned.claim(self.dir, self.run)
        os.environ["TRACKIO_DIR"] = str(self.dir)  # read once, when trackio is first imported
        copy = node_copy(resume, self.node, self.project) if resume else None
        if copy is not None and copy.is_file():
            _backup(copy, self.dir / f"{self.project}.db")
        from trackio import utils
        from trackio.sqlite_storage import SQLiteStorage

        if Path(utils.TRACKIO_DIR) != self.dir:
            raise RuntimeError(f"trackio was imported before orch set TRACKIO_DIR={self.dir}")
        self.storage = SQLiteStorage
        restored = self.storage.get_last_step(project=self.project, run=self.run) if copy and copy.is_file() else None
        print(
            f"[orch] tracking node {self.node} in Trackio project {self.project!r}, run {self.run!r}"
            + (f" (continuing from step {restored})" if restored is not None else ""),
            flush=True,
        )

    def log(self, step: int, record: dict, tokens: int, dist, now: float) -> None:
        """Every rank calls it at a training log (one all-gather of [tokens, GPU bytes]); node mains write."""
        mem = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        from orchestrator.train.collectives import for_collective

        mine = for_collective([float(tokens), float(mem)], torch.float64)
        if dist is not None:
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
        else:
            gathered = [mine]
        if not self.local_main:
            return
        per_node = max(1, len(gathered) // self.nodes)
        ours = [g.tolist() for g in gathered[self.node * per_node : (self.node + 1) * per_node]]
        node_tokens = sum(t for t, _ in ours)
        prefix = f"node{self.node}/"
        row = {f"{prefix}tokens": node_tokens}
        if self.last is not None and now > self.last[0]:
            row[f"{prefix}tokens_per_s"] = (node_tokens - self.last[1]) / (now - self.last[0])
        self.last = (now, node_tokens)
        if torch.cuda.is_available():
            row[f"{prefix}gpu_mem_gb"] = max(m for _, m in ours) / 1e9
            try:
                row[f"{prefix}gpu_util"] = float(torch.cuda.utilization())
            except Exception:  # noqa: BLE001 - NVML missing or refusing: the row goes without it
                pass
        if self.node == 0:
            row = {**{k: v for k, v in record.items() if k != "step"}, **row}
        if self.off or self.storage is None:
            return
        try:
            self.storage.bulk_log(self.project, self.run, [row], steps=[step])
        except Exception as exc:  # noqa: BLE001 - a corrupt database, a full disk: tracking never stops training
            self._failed(f"writing step {step}", exc)

    def copy_to(self, *roots: Path) -> None:
        """This node's database into each root's trackio/node<N>/ (before the save's barrier)."""
        db = self.dir / f"{self.project}.db"
        if self.local_main and not self.off and db.is_file():
            try:
                for root in roots:
                    _backup(db, node_copy(root, self.node, self.project))
            except Exception as exc:  # noqa: BLE001 - tracking never stops training
                self._failed("copying its Trackio database", exc)
