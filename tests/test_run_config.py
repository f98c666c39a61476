"""What a resume changes (train/run_config.py, issue 30 item 7), on the comparison itself: a shape change and a longer
schedule are said and never refused; a changed setting is refused, naming it, unless ORCH_RESUME_CHANGED=on."""

import pytest

from orchestrator.core.errors import OrchError
from orchestrator.train import run_config

pytestmark = pytest.mark.unit


def config(nodes=2, per_node=1, **settings):
    base = {"learning_rate": 1e-5, "beta": 0.1, "max_steps": 8, "GLOBAL_BATCH_SIZE": "16"}
    return {"trainer": "dpo", "settings": {**base, **settings},
            "shape": {"nodes": nodes, "per_node": per_node, "world": nodes * per_node}}  # fmt: skip


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "checkpoint-4"
    path.mkdir()
    run_config.write(path, config())
    return path


def test_the_same_run_resumes_in_silence(ckpt):
    assert run_config.compare(ckpt, config(), anyway=False) == []


def test_another_shape_and_a_longer_schedule_are_said_never_refused(ckpt):
    now = config(nodes=1, per_node=2, max_steps=16)
    lines = run_config.compare(ckpt, now, anyway=False)
    assert lines == ["[orch] note: max_steps 8 -> 16 since checkpoint-4"]
    was = run_config.saved_shape(ckpt)
    assert run_config.shape_line(ckpt, was, now["shape"], "") == (
        "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 2 (world size 2 -> 2: the same "
        "partitions)")
    assert run_config.shape_line(ckpt, was, config(nodes=1)["shape"], "resharded: how") == (
        "[orch] resumed at step 4 from checkpoint-4, saved on 2 x 1, now 1 x 1 (resharded: how)")
    assert run_config.shape_line(ckpt, was, config()["shape"], "") == ""  # the same shape says nothing
    assert run_config.saved_shape(ckpt.parent) == {}  # no orch_config.json (an earlier orch's checkpoint)


def test_a_changed_setting_is_refused_naming_it_unless_asked(ckpt):
    with pytest.raises(OrchError, match=r"trained with other settings: GLOBAL_BATCH_SIZE '16' -> '32', beta 0.1 -> "
                                        r"0.2; to resume anyway set ORCH_RESUME_CHANGED=on"):  # fmt: skip
        run_config.compare(ckpt, config(beta=0.2, GLOBAL_BATCH_SIZE="32"), anyway=False)
    (line,) = run_config.compare(ckpt, config(beta=0.2), anyway=True)
    assert line == "[orch] resuming checkpoint-4 with changed settings (ORCH_RESUME_CHANGED=on): beta 0.1 -> 0.2"


def test_a_checkpoint_of_an_earlier_orch_is_resumed_and_said(tmp_path):
    (line,) = run_config.compare(tmp_path, config(), anyway=False)
    assert "keeps no orch_config.json" in line


def test_grpos_steps_per_generation_follow_the_shape_and_its_generation_batch_is_compared(tmp_path, monkeypatch):
    """TRL's GRPO/RLOO set steps_per_generation to the accumulation, which orch derives from the shape (measured: a
    GRPO run saved on 2 x 1, resumed on 1 x 1, was refused for `steps_per_generation 8 -> 16`); the generation batch
    they keep is what is compared."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    @dataclass
    class Args:
        steps_per_generation: int
        generation_batch_size: int
        learning_rate: float = 1e-5

    def parsed(steps: int, batch: int):
        return SimpleNamespace(trainer="grpo", script_args=None, model_args=None, training_args=Args(steps, batch))

    monkeypatch.setenv("GLOBAL_BATCH_SIZE", "16")
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    run_config.write(ckpt, run_config.of(parsed(8, 16), world=2, nodes=2))  # 1 per device x 2 ranks x 8
    assert run_config.compare(ckpt, run_config.of(parsed(16, 16), world=1, nodes=1), anyway=False) == []
    with pytest.raises(OrchError, match=r"other settings: generation_batch_size 16 -> 8;"):
        run_config.compare(ckpt, run_config.of(parsed(8, 8), world=1, nodes=1), anyway=False)
