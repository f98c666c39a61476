import pytest

from orchestrator.core.errors import OrchError
from orchestrator.node.env import from_env

pytestmark = pytest.mark.unit


def env(**kw):
    base = {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def test_reads_skypilot_env():
    topo = from_env(env())
    assert (topo.nodes, topo.gpus_per_node, topo.node_rank, topo.total_gpus) == (2, 8, 1, 16)
    assert topo.head_ip == "10.0.0.1"
    assert topo.node_ips == ("10.0.0.1", "10.0.0.2")


def test_ips_without_trailing_newline():
    assert from_env(env(SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2")).node_ips == ("10.0.0.1", "10.0.0.2")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"SKYPILOT_NODE_RANK": None}, r"SKYPILOT_NODE_RANK is not set"),
        ({"SKYPILOT_NODE_IPS": None}, r"SKYPILOT_NODE_IPS is not set"),
        ({"SKYPILOT_NUM_NODES": None}, r"SKYPILOT_NUM_NODES is not set"),
        ({"SKYPILOT_NUM_GPUS_PER_NODE": None}, r"SKYPILOT_NUM_GPUS_PER_NODE is not set"),
        ({"SKYPILOT_NODE_RANK": "2"}, r"SKYPILOT_NODE_RANK=2 is outside 0\.\.1"),
        ({"SKYPILOT_NODE_RANK": "-1"}, r"SKYPILOT_NODE_RANK=-1 is outside"),
        ({"SKYPILOT_NODE_IPS": "10.0.0.1\n"}, r"lists 1 address\(es\) but SKYPILOT_NUM_NODES=2"),
        ({"SKYPILOT_NUM_GPUS_PER_NODE": "0"}, r"SKYPILOT_NUM_GPUS_PER_NODE=0: the task has no GPUs"),
        ({"SKYPILOT_NUM_NODES": "0"}, r"at least 1 node"),
        ({"SKYPILOT_NUM_NODES": "two"}, r"SKYPILOT_NUM_NODES='two' is not a whole number"),
    ],
)
def test_inconsistent_env_is_one_clear_error(changes, message):
    with pytest.raises(OrchError, match=message):
        from_env(env(**changes))
