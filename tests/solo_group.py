"""A pytest-xdist scheduler that gives one xdist_group a worker of its own (`--solo-group NAME`, tests/conftest.py).

The Slurm group (the SkyPilot bed and test_slurm.py) is ~17 minutes of one worker that mostly waits: on SkyPilot's
polls, its API server, Slurm and the ranks on the bed's nodes, ~0.3 of a core. Under `--dist loadgroup` it took one
of the suite's two workers for that time while the other ran the CPU-bound tests beside it, ~0.9 of a core idle
(measured 2026-12-07 with the CPU time of every test: 1.1 cores busy over the bed's 17 minutes, 1.9 after it).
With `-n 3 --solo-group slurm` the last worker takes that group alone and stops when it is done; the other two never
take it and run everything else, as the two workers did.

pytest-xdist 3.8's LoadGroupScheduling (loadscope.py) assigns a node the next unit in its queue: this subclass picks
which unit, and stops the solo node. Where there are fewer than 2 workers, or the group is not collected, it is
LoadGroupScheduling (the solo node stops at once when the group is absent)."""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling


class SoloGroupScheduling(LoadGroupScheduling):
    def __init__(self, config, log=None, solo: str = "") -> None:
        super().__init__(config, log)
        self.solo = solo
        self.solo_node = None

    def _solo_alive(self) -> bool:
        return self.solo_node is not None and self.solo_node in self.assigned_work

    def _give(self, node, scope: str) -> None:
        """LoadScopeScheduling._assign_work_unit, for the unit named `scope` rather than the first."""
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _assign_work_unit(self, node) -> None:
        if self.solo_node is None and len(self.nodes) > 1:
            self.solo_node = self.nodes[-1]  # chosen once, at the first assignment: the last worker started
        if node is self.solo_node:
            if self.solo in self.workqueue:
                self._give(node, self.solo)
            if not node.shutting_down:
                node.shutdown()  # xdist's "no more work": it runs what it was given (if anything), then stops
            return
        # the others take every unit in order but the solo group, unless its worker is gone (crashed): then anyone
        scope = next((s for s in self.workqueue if s != self.solo or not self._solo_alive()), None)
        if scope is not None:
            self._give(node, scope)

    def _reschedule(self, node) -> None:
        if node is not self.solo_node:
            super()._reschedule(node)
