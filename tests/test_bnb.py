"""Launches that use no bitsandbytes run without it where it is installed, as their nodes (no quant extra) do: the
rehearsal and a smoke run's ranks skip its import, ~1 s of CPU per process here (core/bnb.py). Read back from the
processes' own imports (`python -X importtime`), not from the flag."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, Rehearsed

from orchestrator.core import bnb, smoke
from orchestrator.launch import recipe as recipes
from orchestrator.launch.backends import local_backend
from orchestrator.launch.resolved import resolve

LOADED = re.compile(r"^import time:.*\| +bitsandbytes\.", re.M)  # its submodules: the package really ran


def imports_bitsandbytes(argv: list[str], env: dict[str, str], stdin: str = "") -> bool:
    assert importlib.util.find_spec("bitsandbytes") is not None, "the dev environment has bitsandbytes (quant extra)"
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120)  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return bool(LOADED.search(done.stderr))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("settings", "uses"),
    [
        ({}, False),
        ({"optim": "adamw_torch_fused", "load_in_4bit": False}, False),
        ({"load_in_4bit": True}, True),
        ({"load_in_4bit": "yes"}, True),  # as an override gives it
        ({"load_in_8bit": "true"}, True),
        ({"optim": "paged_adamw_8bit"}, True),
        ({"optim": "lion_32bit"}, True),
    ],
)
def test_a_launch_uses_bitsandbytes_for_4_or_8_bit_loading_or_its_optimizers(settings, uses):
    assert bnb.uses(lambda key, default: settings.get(key, default)) is uses


@pytest.mark.e2e  # three imports of the training stack: seconds each
def test_a_rank_told_off_never_imports_it_and_peft_and_transformers_see_it_absent(monkeypatch):
    env = {k: v for k, v in __import__("os").environ.items() if k != bnb.ENV}
    train = ["-m", "orchestrator.train", "sft", "--help"]
    assert imports_bitsandbytes(train, env)  # installed here: PEFT's import brings it in
    assert not imports_bitsandbytes(train, {**env, bnb.ENV: "off"})
    probe = ("from orchestrator.core import bnb; bnb.hide(); import peft.helpers, peft.import_utils as p; "
             "import transformers.utils.import_utils as t; "
             "print(peft.helpers.bnb, p.is_bnb_available(), t.is_bitsandbytes_available())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.stdout.split() == ["None", "False", "False"], out.stderr[-2000:]


@pytest.mark.e2e
def test_the_rehearsal_imports_it_only_for_a_batch_that_uses_it():
    env = dict(__import__("os").environ)
    role = ["-m", "orchestrator.rehearsal.role"]
    batch = {"trainer": "sft", "devices": 0, "smoke": ["", "sft", ""], "roles": []}
    assert imports_bitsandbytes(role, env, json.dumps({"batches": [{**batch, "bitsandbytes": True}]}))
    assert not imports_bitsandbytes(role, env, json.dumps({"batches": [{**batch, "bitsandbytes": False}]}))


@pytest.mark.unit
def test_smoke_runs_tell_their_ranks_off_unless_the_settings_use_it(monkeypatch, tmp_path):
    from orchestrator.node import exec as node_exec

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smoke, "ensure", lambda artifacts: None)

    def local(name, **overrides):
        launch = resolve(recipes.load(str(ROOT / "recipes" / f"{name}.yaml")))
        return local_backend._smoke(launch, {}, overrides)[0].envs.get(bnb.ENV)

    assert local("phi3_dpo_fsdp") == "off"
    assert local("phi3_dpo_fsdp", optim="paged_adamw_8bit") is None  # the user's word counts
    assert local("llama3_70b_qlora_fsdp") is None  # load_in_4bit: QLoRA quantises on CPU with it
    node = {"TRL_TRAINER": "dpo", "TRL_CONFIG": "recipes/trl/phi3_dpo.yaml",
            "ACCELERATE_CONFIG": "recipes/accelerate/fsdp2_phi3.yaml", "GLOBAL_BATCH_SIZE": "96"}  # fmt: skip
    monkeypatch.chdir(ROOT)
    assert node_exec.smoke_env(node).get(bnb.ENV) == "off"
    assert node_exec.smoke_env({**node, "TRL_OVERRIDES": "load_in_8bit=true"}).get(bnb.ENV) is None


@pytest.mark.unit
def test_the_launch_and_the_head_node_hand_the_rehearsal_whether_the_launch_uses_it(handed):
    from orchestrator.core.accelerators import Gpus
    from orchestrator.launch import checks

    cases = (("phi3_dpo_fsdp", {}), ("phi3_dpo_fsdp", {"optim": "adamw_8bit"}), ("llama3_70b_qlora_fsdp", {}))
    for name, words in cases:
        recipe = recipes.load(str(ROOT / "recipes" / f"{name}.yaml"))
        launch = resolve(recipe, gpus=Gpus("H100", 8), trl_overrides=words)
        with pytest.raises(Rehearsed):
            checks.rehearse(launch, checks.Checked(checks.previews(launch), None))
    assert [b.bitsandbytes for b in handed] == [False, True, True]
