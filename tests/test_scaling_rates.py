"""core/scaling.py on its own: what keys a rate, a single-node run records, a multi-node run compares."""

import json

import pytest

from orchestrator.core import scaling

pytestmark = pytest.mark.unit


def config(nodes: int, per_node: int, **settings) -> dict:
    return {"trainer": "sft", "settings": {"learning_rate": 2e-5, "max_steps": 100, **settings},
            "shape": {"nodes": nodes, "per_node": per_node, "world": nodes * per_node}}  # fmt: skip


def test_the_key_leaves_out_the_schedule_and_keeps_what_changes_a_ranks_rate():
    base = scaling.key(config(1, 8), 4, "NVIDIA H100 80GB HBM3")
    assert scaling.key(config(2, 8, max_steps=500), 4, "NVIDIA H100 80GB HBM3") == base  # 2 x 8 vs 1 x 8
    assert scaling.key(config(1, 4), 4, "NVIDIA H100 80GB HBM3") != base  # processes per node
    assert scaling.key(config(1, 8), 8, "NVIDIA H100 80GB HBM3") != base  # batch per device
    assert scaling.key(config(1, 8), 4, "NVIDIA A100-SXM4-80GB") != base
    assert scaling.key(config(1, 8, learning_rate=1e-5), 4, "NVIDIA H100 80GB HBM3") != base


def test_one_node_records_and_several_compare(tmp_path, monkeypatch):
    monkeypatch.delenv("CHECKPOINT_ROOT", raising=False)
    assert scaling.compare_or_record("k", 100.0, config(1, 8)["shape"], "run-a") is None  # no root: nothing kept
    monkeypatch.setenv("CHECKPOINT_ROOT", str(tmp_path))
    assert scaling.compare_or_record("k", 100.0, config(2, 8)["shape"], "run-b") is None  # nothing to compare yet
    assert scaling.compare_or_record("k", 1000.0, config(1, 8)["shape"], "run-c") is None
    assert json.loads((tmp_path / "orch_rates.json").read_text())["k"]["per_rank_tokens_per_s"] == 1000.0
    found = scaling.compare_or_record("k", 950.0, config(2, 8)["shape"], "run-d")
    assert found["efficiency"] == pytest.approx(0.95)
    assert scaling.line(found).startswith("[orch] scaling efficiency: 95% of the single-node rate per rank (950 tok/s "
                                          "per rank on 2 x 8; 1,000 on 1 x 8 by run run-c, ")  # fmt: skip
    (tmp_path / "orch_rates.json").write_text("[not a record")
    assert scaling.compare_or_record("k", 950.0, config(2, 8)["shape"], "run-e") is None  # unreadable: said nothing
