"""Out of memory on a rank: the run ends with the rank's error and one line naming the fix that
keeps the math; --auto-fit retries once with it. The error is injected on node 1 the way a rank prints it."""

import re

import pytest
from conftest import orch

from orchestrator.core import memory_fix
from orchestrator.node.output import error_of, first_error

pytestmark = pytest.mark.cli

CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.12 GiB is free."
)


def test_the_first_error_is_the_ranks_not_the_launchers():
    lines = [
        f"[rank1]: {CUDA_OOM}",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "subprocess.CalledProcessError: Command '['torchrun', ...]' returned non-zero exit status 1.",
    ]
    extracted = [e for e in map(error_of, lines[1:] + lines[:1]) if e]  # as the node output pumps do
    assert first_error(extracted) == CUDA_OOM  # the launchers' summaries come first in the log and are skipped
    assert memory_fix.is_oom(first_error(lines))
    assert memory_fix.is_oom(
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    )
    assert not memory_fix.is_oom("ValueError: Unknown loss type: nonsense")


@pytest.mark.parametrize(
    "settings, envs, words",
    [
        ({"per_device_train_batch_size": 8}, {"GLOBAL_BATCH_SIZE": "128"}, "per_device_train_batch_size=4"),
        ({"per_device_train_batch_size": "4", "gradient_accumulation_steps": 2}, {}, "per_device_train_batch_size=2 "
         "gradient_accumulation_steps=4"),
        ({}, {}, "per_device_train_batch_size=4 gradient_accumulation_steps=2"),  # TrainingArguments' default 8
    ],
)  # fmt: skip
def test_the_fix_keeps_the_global_batch(settings, envs, words):
    assert memory_fix.propose(settings, envs, processes=8).words() == words


def test_at_batch_one_the_fix_is_to_shard_more():
    fix = memory_fix.propose({"per_device_train_batch_size": 1}, {})
    assert fix.overrides is None and "shard more" in fix.describe()


PROCESSES = 8  # the training processes of the runs below (data-parallel over all of them)


@pytest.mark.parametrize("trainer, settings, envs, words, said", [
    # an odd batch: halving it (5 -> 2) shrank the global batch, or left GLOBAL_BATCH_SIZE no whole accumulation
    ("sft", {"per_device_train_batch_size": 5}, {}, "per_device_train_batch_size=1 gradient_accumulation_steps=5",
     "cut the per-device batch (5 -> 1) and multiply the accumulation by 5 (1 -> 5)"),
    ("sft", {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2}, {},
     "per_device_train_batch_size=3 gradient_accumulation_steps=4", "halve the per-device batch (6 -> 3)"),
    ("sft", {"per_device_train_batch_size": 9}, {"GLOBAL_BATCH_SIZE": "144"}, "per_device_train_batch_size=3",
     "multiply the accumulation by 3 (2 -> 6; GLOBAL_BATCH_SIZE=144 kept"),
    # a rank's samples a step (batch x accumulation) divide by more than the batch's own divisors: 7 x 2 becomes 2 x 7,
    # not 1 x 14 (the largest at most half the batch, as the launch-side refusal's core/batch.smaller lists them)
    ("sft", {"per_device_train_batch_size": 7, "gradient_accumulation_steps": 2}, {},
     "per_device_train_batch_size=2 gradient_accumulation_steps=7", "cut the per-device batch (7 -> 2) and lengthen "
     "the accumulation (2 -> 7)"),
    ("dpo", {"per_device_train_batch_size": 7}, {"GLOBAL_BATCH_SIZE": "112"}, "per_device_train_batch_size=2",
     "(7 -> 2) and lengthen the accumulation (2 -> 7; GLOBAL_BATCH_SIZE=112 kept, the nodes derive it)"),
    # KTO takes no per-device batch below 2 (node/rules.check_trainer_batch): 3 -> 1 would be refused
    ("kto", {"per_device_train_batch_size": 4}, {}, "per_device_train_batch_size=2 gradient_accumulation_steps=2",
     "halve"),
    ("kto", {"per_device_train_batch_size": 3}, {}, "", "no per-device batch below 3 keeps the 3 samples a rank takes "
     "a step whole (KTO takes no less than 2: its KL baseline"),
    ("kto", {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}, {},
     "per_device_train_batch_size=2 gradient_accumulation_steps=3", "cut the per-device batch (3 -> 2)"),
    ("kto", {"per_device_train_batch_size": 2}, {}, "", "the per-device batch is already 2 (KTO takes no less than 2"),
    # GRPO with steps_per_generation: the generation batch (batch x processes x steps) kept whole for num_generations
    ("grpo", {"per_device_train_batch_size": 8, "steps_per_generation": 4}, {"GLOBAL_BATCH_SIZE": "64"},
     "per_device_train_batch_size=4 steps_per_generation=8", "halve"),
    # an explicit generation_batch_size stays one TRL takes (a multiple of the per-device batch x processes)
    ("grpo", {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2, "generation_batch_size": 96}, {},
     "per_device_train_batch_size=3 gradient_accumulation_steps=4", "halve"),
])  # fmt: skip
def test_the_fix_is_one_the_trainer_and_the_batch_math_accept(trainer, settings, envs, words, said):
    """The OOM fix halved the per-device batch whatever it was: an odd one changed the global batch, and KTO's batch of
    2 or 3 became 1, which the node refuses. The fix must pass the node's own batch checks and keep the global batch;
    a GRPO run's generation batch stays one TRL takes."""
    from orchestrator.core import batch
    from orchestrator.core.errors import OrchError
    from orchestrator.node import rules

    fix = memory_fix.propose(settings, {"TRL_TRAINER": trainer, **envs}, PROCESSES)
    assert fix.words() == words and said in fix.describe(), fix.describe()
    if fix.overrides is None:
        with pytest.raises(OrchError):  # what halving would have given
            rules.check_trainer_batch(trainer, None, {**settings, "per_device_train_batch_size": 1})
        return
    fixed = {**settings, **fix.overrides}
    global_batch = int(envs.get("GLOBAL_BATCH_SIZE", 0)) or None
    rules.check_trainer_batch(trainer, global_batch, fixed, batch.per_device_batch(fixed) * PROCESSES)
    before = batch.per_device_batch(settings) * PROCESSES * batch.steps_of(settings, global_batch, PROCESSES)
    assert batch.per_device_batch(fixed) * PROCESSES * batch.steps_of(fixed, global_batch, PROCESSES) == before
    assert 2 * batch.per_device_batch(fixed) <= batch.per_device_batch(settings) or trainer == "kto"
    if "steps_per_generation" in settings:
        assert (int(fixed["per_device_train_batch_size"]) * int(fixed["steps_per_generation"])
                == settings["per_device_train_batch_size"] * settings["steps_per_generation"])  # fmt: skip
    if "generation_batch_size" in settings:  # TRL's own rule (GRPOConfig.__post_init__)
        assert settings["generation_batch_size"] % (batch.per_device_batch(fixed) * PROCESSES) == 0


@pytest.fixture
def oom_recipe(project):
    """qwen25_sft_ddp whose node 1 fails as a rank out of memory does, while the per-device batch is 2."""
    recipe = project / "recipes" / "qwen25_sft_oom.yaml"
    text = (project / "recipes" / "qwen25_sft_ddp.yaml").read_text()
    inject = (
        '  case "$TRL_OVERRIDES" in *per_device_train_batch_size=2*) if [ "$SKYPILOT_NODE_RANK" = 1 ]; then '
        f"python -c 'import sys; print(\"[rank1]: {CUDA_OOM}\"); sys.exit(1)'; exit 1; fi;; esac\n  orch node\n"
    )
    recipe.write_text(text.replace("\n  orch node\n", "\n" + inject))
    return project


@pytest.mark.e2e
def test_out_of_memory_names_the_fix_and_auto_fit_retries_once(oom_recipe):
    command = ["run", "qwen25_sft_oom", "--local", "--nodes", "2", "--smoke", "per_device_train_batch_size=2"]
    failed = orch(*command, cwd=oom_recipe, timeout=300)
    assert failed.returncode == 1, failed.stdout[-3000:]
    lines = failed.stdout.strip().splitlines()
    assert re.match(
        r"\[orch\] failed after [\d.]+ s: node 1 exited with code 1: torch.OutOfMemoryError: CUDA out", lines[-3]
    )
    assert lines[-2].startswith("[orch] out of memory: halve the per-device batch (2 -> 1) and double the accumulation")
    assert lines[-1] == "[orch] rerun with per_device_train_batch_size=1, or add --auto-fit to do it by itself"

    fitted = orch(*command, "--auto-fit", cwd=oom_recipe, timeout=300)
    assert fitted.returncode == 0, fitted.stdout[-3000:]
    assert "[orch] --auto-fit: retrying once with per_device_train_batch_size=1" in fitted.stdout
    summary = re.search(
        r"\[orch\] (\d+) optimizer steps x 16 samples \(= 1 per device x 2 data-parallel ranks x 8", fitted.stdout
    )
    assert summary, fitted.stdout[-2000:]  # the smoke global batch of 16 kept: accumulation 4 -> 8


def test_node_output_keeps_no_raw_control_bytes():
    from orchestrator.node.output import printable

    line = "completion: \x00\x07ab\x1b[31mred\x1b[0m\tcol\r\x7f\x1f\n"
    assert printable(line) == "completion: \ufffd\ufffdab\x1b[31mred\x1b[0m\tcol\r\ufffd\ufffd\n"


def test_a_node_whose_rank_ran_out_of_memory_names_the_fix_then_quotes_the_error(tmp_path):
    """On a GPU cluster, plain `sky launch` included: supervise() (node/supervise.py) under a stand-in rank that fails
    as a CUDA rank does; the fix line comes before the failure line, which stays the last, and it says how to pass the
    fix to either launcher (the recipe's TRL_OVERRIDES kept)."""
    from conftest import supervised

    rank = f"import sys; print({f'[rank1]: {CUDA_OOM}'!r}, file=sys.stderr, flush=True); sys.exit(1)"
    done = supervised(rank, tmp_path, env={"TRL_OVERRIDES": "beta=0.1 max_length=512"},
                      settings={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2})  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("[orch]")]
    assert lines[-2] == (
        "[orch] out of memory: halve the per-device batch (8 -> 4) and double the accumulation (2 -> 4): the same "
        "global batch, so the same math; or a strategy that shards more: rerun with per_device_train_batch_size=4 "
        "gradient_accumulation_steps=4 (`orch run RECIPE per_device_train_batch_size=4 gradient_accumulation_steps=4`"
        ", or `sky launch ... --env TRL_OVERRIDES='beta=0.1 max_length=512 per_device_train_batch_size=4 "
        "gradient_accumulation_steps=4'`)"
    )
    assert lines[-1] == f"[orch] failed on node 0: accelerate exited with code 1: {CUDA_OOM}"
