"""tests/own_worker.py: `--own-worker slurm` keeps the last xdist worker for the Slurm group, driven here as
pytest-xdist's DSession drives a scheduler:
add_node, add_node_collection, schedule, mark_test_complete, remove_node."""

from types import SimpleNamespace

import pytest
from own_worker import OwnWorkerScheduling

pytestmark = pytest.mark.unit

COLLECTION = [
    "tests/test_a.py::test_1",
    "tests/test_a.py::test_2",
    "tests/test_slurm.py::test_s1@slurm",
    "tests/test_sky_bed.py::test_b1@slurm",
    "tests/test_sky_bed.py::test_b2@slurm",
    "tests/test_b.py::test_1",
    "tests/test_b.py::test_2",
    "tests/test_rehearsal.py::test_r1@test_rehearsal",
    "tests/test_rehearsal.py::test_r2@test_rehearsal",
]


class Worker:
    def __init__(self, n: int) -> None:
        self.gateway = SimpleNamespace(id=f"gw{n}")
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def config(workers: int, group: str = "slurm"):
    options = {"--own-worker": group}
    return SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], getoption=options.__getitem__,
                           option=SimpleNamespace(loadscopereorder=True))  # fmt: skip


def scheduled(workers: int, collection: list[str] = COLLECTION):
    sched = OwnWorkerScheduling(config(workers))
    nodes = [Worker(n) for n in range(workers)]
    for node in reversed(nodes):  # workers register in any order
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def run_all(sched, nodes, collection=COLLECTION) -> dict[str, list[str]]:
    """Each worker runs what it was sent, in turns, until the scheduler says the tests are finished and the workers
    have run what they hold (xdist's tests_finished allows each worker one test left)."""
    ran = {node.gateway.id: [] for node in nodes}
    while not sched.tests_finished or any(node.sent for node in nodes):
        progressed = False
        for node in nodes:
            if node.sent:
                index = node.sent.pop(0)
                ran[node.gateway.id].append(collection[index])
                sched.mark_test_complete(node, index)
                progressed = True
            elif node.shutting_down and node in sched.assigned_work:
                sched.remove_node(node)
        assert progressed or sched.tests_finished, f"stalled: {ran}"
    assert not sched.workqueue
    return ran


def test_the_last_worker_runs_the_group_alone_and_the_others_everything_else():
    sched, nodes = scheduled(3)
    ran = run_all(sched, nodes)
    assert sorted(ran["gw2"]) == sorted(t for t in COLLECTION if t.endswith("@slurm"))
    rest = ran["gw0"] + ran["gw1"]
    assert sorted(rest) == sorted(t for t in COLLECTION if not t.endswith("@slurm"))
    assert ran["gw0"] and ran["gw1"]  # both share the rest
    assert nodes[2].shutting_down


def test_without_the_group_the_kept_worker_stops_at_once_and_the_others_run_everything():
    collection = [t for t in COLLECTION if not t.endswith("@slurm")]
    sched, nodes = scheduled(3, collection)
    assert nodes[2].shutting_down and not nodes[2].sent
    ran = run_all(sched, nodes, collection)
    assert sorted(ran["gw0"] + ran["gw1"]) == sorted(collection) and not ran["gw2"]


def test_one_worker_runs_everything():
    sched, nodes = scheduled(1)
    assert sorted(run_all(sched, nodes)["gw0"]) == sorted(COLLECTION)


def test_a_kept_worker_that_crashes_leaves_its_group_to_the_others():
    sched, nodes = scheduled(3)
    kept = nodes[2]
    first = kept.sent.pop(0)
    sched.mark_test_complete(kept, first)
    kept.sent.clear()
    sched.remove_node(kept)  # DSession.worker_errordown: the group's pending tests go back to the queue
    ran = run_all(sched, nodes[:2])
    done = ran["gw0"] + ran["gw1"] + [COLLECTION[first]]
    assert sorted(done) == sorted(COLLECTION)
