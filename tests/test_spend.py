"""Spend across attempts (issue 32, item 3): a run's orch_spend.json next to its checkpoints keeps every attempt, so the
cost cap and the summary count them all (train/spend.py)."""

import json
import re
import shutil

import pytest
from conftest import orch

from orchestrator.train import spend


@pytest.mark.unit
def test_the_record_keeps_each_attempt_and_sums_the_others(tmp_path):
    assert spend.read(tmp_path) == {} and spend.earlier(tmp_path, "a") == (0.0, 0.0, 0)
    spend.write(tmp_path, "a", 100.0, 30.0, 3600.0)
    spend.write(tmp_path, "a", 100.0, 60.0, 3600.0)  # the same attempt, later: replaced, not added
    spend.write(tmp_path, "b", 200.0, 10.0, 7200.0)  # recovered elsewhere, at another price
    spend.write(tmp_path, "c", 300.0, 5.0, None)  # no price known: its time still counts
    assert spend.earlier(tmp_path, "c") == (pytest.approx(80.0), pytest.approx(70.0), 2)
    assert spend.earlier(tmp_path, "d") == (pytest.approx(80.0), pytest.approx(75.0), 3)
    assert [p.name for p in tmp_path.iterdir()] == ["orch_spend.json"]  # no temporary file left
    (tmp_path / "orch_spend.json").write_text("{not json")
    assert spend.read(tmp_path) == {}  # unreadable: this attempt counts alone, as before the record


@pytest.mark.e2e
def test_the_cost_cap_and_the_summary_count_every_attempt(project):
    command = ["run", "qwen25_sft_ddp", "--local", "--nodes", "2", "--smoke", "--env", "ORCH_PRICE_PER_HOUR=3600"]
    first = orch(*command, cwd=project)  # $1 a second
    assert first.returncode == 0, first.stdout[-3000:]
    output_dir = project / re.search(r"^\[orch\] output: (\S+)$", first.stdout, re.M).group(1)
    (recorded,) = json.loads((output_dir / "orch_spend.json").read_text())["attempts"].values()
    assert recorded["usd"] > 1 and recorded["price_per_hour"] == 3600

    # the attempt is lost after step 4; the next one, capped, starts where the first left off and so does its spend:
    # the cap is the first attempt's spend plus the minute kept for a checkpoint and one more second, which this
    # attempt's own start-up crosses, so it stops at its first step (without the record it would run to the end)
    shutil.rmtree(output_dir / "checkpoint-8")
    cap = recorded["usd"] + 61
    second = orch(*command, "--max-cost", f"{cap:.2f}", cwd=project)
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"[orch] output: {output_dir.relative_to(project)}\n" in second.stdout  # --max-cost keeps the run
    assert f"(node0) [orch] spend: 1 earlier attempt(s) of this run, ${recorded['usd']:,.2f} over " in second.stdout
    stopped = re.search(r"\[orch\] stopped early at step 5: cost cap: \$([\d,.]+) spent over 2 attempts at "
                        r"\$3,600.00/h", second.stdout)  # fmt: skip
    assert stopped, second.stdout[-3000:]
    attempts = json.loads((output_dir / "orch_spend.json").read_text())["attempts"]
    assert len(attempts) == 2
    total = sum(a["usd"] for a in attempts.values())
    assert float(stopped.group(1).replace(",", "")) >= recorded["usd"]
    summary = re.search(r"^\[orch\] throughput: .*; \$([\d,.]+) spent over 2 attempts$", second.stdout, re.M)
    assert summary and float(summary.group(1).replace(",", "")) == pytest.approx(total, abs=0.01)
