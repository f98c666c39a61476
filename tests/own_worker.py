"""`--own-worker GROUP`: pytest-xdist's loadgroup scheduling with one worker kept for one group's tests.

The SkyPilot bed's tests (xdist_group "slurm", with the Slurm tests that share its munged) mostly wait: on SkyPilot's
provisioning, its controllers' polls, a cluster's recovery. Handed to one of two workers as any other group, they took
that worker for ~10 minutes while the machine's two cores were far from busy, and the suite ran the rest on one
worker meanwhile. With this option the last worker (gwN-1) runs that group and nothing else, and the others run
everything else from the start, as they do without the group: what the group adds is its CPU, not its waiting.
Without the group among the selected tests the kept worker stops at once.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling


class OwnWorkerScheduling(LoadGroupScheduling):
    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self.group = config.getoption("--own-worker")
        self.kept = f"gw{self.numnodes - 1}" if self.numnodes > 1 else None  # the workers planned, gw0.. in order

    def _is_kept(self, node) -> bool:
        return node.gateway.id == self.kept

    def _kept_alive(self) -> bool:
        return any(self._is_kept(node) and not node.shutting_down for node in self.assigned_work)

    def _assign_work_unit(self, node) -> None:
        if self._is_kept(node):
            if self.group not in self.workqueue:
                node.shutdown()  # its group is done, running or not selected: the others take the rest
                return
            self.workqueue.move_to_end(self.group, last=False)  # the parent hands out the queue's first unit
        elif self._kept_alive():
            others = [scope for scope in self.workqueue if scope != self.group]
            if not others:
                return  # only the kept worker's group is left
            self.workqueue.move_to_end(others[0], last=False)
        super()._assign_work_unit(node)
