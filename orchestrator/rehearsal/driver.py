"""Rehearse launches' rank roles against the owners' code (driver; imports nothing heavy).

A launch of N nodes has at most three distinct roles: the head (node 0), any other trainer node (all alike but
for their rank), and the vLLM server node. The roles of one or many launches are rehearsed in one subprocess
(`orchestrator.rehearsal.role`) that imports the training stack once and forks per role; see that module for
what runs. The recipe's model and data are replaced by the tiny smoke model and data of the same family and
trainer (built in that subprocess, cached), and what needs a GPU or the network is swapped for what runs here;
every swap is listed. Results are cached by a hash of what decides them: the roles' argv and env, the swaps,
the config files the argv names, the installed versions and orch's own code.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from orchestrator.core import bnb, configs, home, trainers
from orchestrator.core.overrides import truthy
from orchestrator.node.plan import NodePlan

PORTABLE_ATTENTION = ("sdpa", "eager")
DEFAULT_CAPABILITY = (9, 0)  # what the fake CUDA reports for a GPU orch has no capability for (fake_gpu.capability)
STACK = ("torch", "transformers", "trl", "accelerate", "deepspeed", "datasets")
PROCESS_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    # DeepSpeed picks its accelerator from torch.cuda, which the rehearsal fakes: keep its tensors on CPU
    # (TRL initializes DPO/KTO reference models with deepspeed.initialize in the trainer's constructor).
    "DS_ACCELERATOR": "cpu",
}
# What the owners' refusals mean for the user: a pattern of the error and the fix to name.
FIXES = (
    (r"ds gradient_accumulation_steps=\S+ vs hf|train_batch_size is not equal to micro_batch_per_gpu",
     "set gradient_accumulation_steps to \"auto\" in the DeepSpeed config (orch gives accelerate and TRL the "
     "value GLOBAL_BATCH_SIZE needs)"),
    (r"mismatch TrainingArguments", "set these DeepSpeed config values to \"auto\" or to the TRL config's"),
    (r"Packing is not compatible with context parallelism", "set packing=false (and eval_packing=false)"),
    (r"When using `deepspeed_config_file`, the following accelerate config variables will be ignored",
     "move those settings into the DeepSpeed JSON and out of the Accelerate config"),
    (r"ParallelismConfig total_size", "make the parallelism sizes multiply to the process count"),
    (r"liger-kernel >= \S+ is not available",
     "the nodes get Liger with orch's gpu extra (the recipe's setup: bash scripts/node-setup.sh train,gpu), or set "
     "use_liger_kernel=false"),
    (r"vLLM is not available and `use_vllm` is set to True",
     "the nodes get vLLM with orch's vllm extra (the recipe's setup: bash scripts/node-setup.sh train,gpu,vllm), or "
     "set use_vllm=false"),
    (r"install `bitsandbytes` in order to use bitsandbytes optimizers",
     "the nodes get bitsandbytes with orch's quant extra (the recipe's setup: bash scripts/node-setup.sh "
     "train,quant), or choose another optim"),
    (r"--tf32 requires Ampere or a newer GPU arch",
     "TF32 needs compute capability 8.0 or more (A100, A10G, L4, L40S, H100; not T4 or V100): set tf32=false"),
    (r"You need to (install|have) `\S+` in order to use|ValueError: Please install \S",
     "the nodes install uv.lock's orch[train] (and the recipe's extras), which does not have it: put the package in "
     "pyproject.toml's train extra, then `make lock`, or choose another optim"),
    (r"FP8 is not available on this machine",
     "the nodes install uv.lock's orch[train] and the recipe's extras, which have no FP8 backend (torchao, "
     "Transformer Engine, MS-AMP): put one in pyproject.toml's train extra, then `make lock`, or set "
     "mixed_precision: bf16"),
    (r"missing \d+ required positional argument",
     "a reward function reads a column the rows lack: give it in every row (accuracy_reward reads `solution`)"),
    (r"min_lr or min_lr_rate should be set",
     "set lr_scheduler_kwargs='{\"min_lr_rate\": 0.1}' (a JSON object: min_lr or min_lr_rate), or another "
     "lr_scheduler_type"),
    (r"get_\w+_schedule\w*\(\) (missing|got an unexpected)",
     "give the schedule's own arguments in lr_scheduler_kwargs, a JSON object (warmup_stable_decay: "
     "lr_scheduler_kwargs='{\"num_decay_steps\": 100}'), or another lr_scheduler_type"),
    (r"Attempting to unscale FP16 gradients",
     "fp16=true scales fp32 weights' gradients: load the model in fp32 (dtype=float32; fp16 stays the compute dtype), "
     "train a LoRA adapter (fp32), or use bf16=true on GPUs of compute capability 8.0 or more"),
    (r"Unable to JIT load the async_io op",
     "NVMe offload needs DeepSpeed's async_io op, which builds against libaio: add `sudo apt-get install -y "
     "libaio-dev` to the recipe's setup before scripts/node-setup.sh (`ds_report` shows what DeepSpeed can build), "
     "or offload to cpu"),
    (r"Callback requires \S+ to be installed",
     "the nodes install uv.lock's orch[train], which has no tracker (`orch run --track` adds Trackio and logs every "
     "node's curves to it): put the tracker's package in pyproject.toml's train extra, then `make lock`"),
)  # fmt: skip


class Role(NamedTuple):
    """What one node runs: the argv it execs, the variables it sets first, trainer or vllm-server."""

    name: str
    argv: list[str]
    env: dict[str, str] = {}
    role: str = "trainer"


class Batch(NamedTuple):
    """The roles of one launch."""

    trainer: str
    roles: list[Role]
    substitute: list[str]
    devices: int
    """GPUs per node to report."""
    smoke: tuple[str, str, str]
    """(model type, trainer, cache dir) of the tiny model and data the substitutions point at."""
    quantized: bool = False
    """load_in_4bit: the rehearsal quantises on CPU (orchestrator/rehearsal/role.py)."""
    bitsandbytes: bool = True
    """The launch may use bitsandbytes (core/bnb.uses); False: rehearsed as a node without it is (core/bnb.hide)."""
    capability: tuple[int, int] | None = None
    """The GPU's CUDA compute capability, which the fake CUDA reports (tf32 needs 8.0); None: DEFAULT_CAPABILITY."""
    nvme: bool = False
    """DeepSpeed's NVMe offload rehearsed as it is (the head node: its own DeepSpeed builds async_io against its own
    libaio, or says why not); False: as CPU offload (the laptop's libaio says nothing about the nodes')."""


def quantisation(setting, loads: str | None) -> tuple[bool, bool]:
    """A Batch's (quantized, bitsandbytes) from the TRL settings (`setting(key, default)`: Launch.setting, dict.get)
    and the setting a bitsandbytes-quantised checkpoint loads as (`loads`, core/models.quantized; None for another
    model): the launch side and the head node rehearse the same way."""
    quantized = truthy(setting("load_in_4bit", False)) or loads == "load_in_4bit"
    return quantized, bnb.uses(setting) or loads is not None


class Outcome(NamedTuple):
    role: str
    ok: bool
    facts: dict
    stage: str = ""
    error: str = ""

    def fix(self) -> str:
        return next((fix for pattern, fix in FIXES if re.search(pattern, self.error)), "")


def stack_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "trl", "accelerate"))


def versions() -> dict[str, str]:
    """The training stack's installed versions: from the name of each package's `<name>-<version>.dist-info`
    directory, the first along sys.path as importlib.metadata finds it (the wheel standard names it so), else from
    importlib.metadata. Importing it and parsing six METADATA files took ~35 ms of a ~85 ms dry run."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if folder.endswith(".dist-info"):
                name, _, version = folder.removesuffix(".dist-info").partition("-")
                found.setdefault(re.sub(r"[-_.]+", "_", name).lower(), version)
    out = {}
    for name in STACK:
        if found.get(name):
            out[name] = found[name]
            continue
        import importlib.metadata

        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def roles(plans: list[NodePlan]) -> list[tuple[str, NodePlan]]:
    """The distinct roles of a launch (from the plans of its representative ranks): the head, one other trainer
    node, the vLLM server node."""
    trainers = [p for p in plans if p.role == "trainer"]
    out = [("head (node 0)", trainers[0])]
    if len(trainers) > 1:
        out.append((f"trainer node {trainers[1].topology.node_rank}", trainers[1]))
    out += [(f"vLLM server (node {p.cluster.node_rank})", p) for p in plans if p.role == "vllm-server"]
    return out


def substitutions(
    trainer: str, settings: Mapping[str, object], smoke_dir: Path, output_dir: str, node: bool = False,
    loads: str | None = None, data_dir: Path | None = None,
) -> list[str]:
    """TRL script arguments appended after orch's (later flags win) so the trainer builds here without GPU or
    network: the tiny model and data of the recipe's family, portable attention, no vLLM engine. The trackers of
    report_to are made, not started (probes.trackers). `node`: rehearsed on the head node (`orch node --rehearse`),
    whose environment is the ranks': Liger or vLLM not installed there is a finding (the owners' checks say it), not
    a swap; a laptop swaps them off (their GPU-only packages are the nodes' extras, launch/checks.check_extras).
    `loads`: the TRL setting a bitsandbytes-quantised checkpoint loads as (core/models.quantized), given to the tiny
    model, which is not one, so transformers' quantizer and its training checks run as on the nodes. `data_dir`: a
    --data file's first rows in place of the smoke data (TRL prepares them, the reward functions read them)."""
    words = [
        "--model_name_or_path", str(smoke_dir / "model"),
        "--dataset_name", str(data_dir or smoke_dir / "data"),
        "--dataset_train_split", "train",
        "--dataset_test_split", "train",  # the smoke data's only split: an eval_strategy evaluates on it
        "--output_dir", output_dir,
    ]  # fmt: skip
    if loads and not truthy(settings.get(loads, False)):
        words += [f"--{loads}", "true"]
    if str(settings.get("attn_implementation") or "sdpa") not in PORTABLE_ATTENTION:
        words += ["--attn_implementation", "sdpa"]
    if truthy(settings.get("use_liger_kernel", False)) and not importable("liger_kernel") and not node:
        words += ["--use_liger_kernel", "false"]
    # the reference model over the whole dataset on the GPU, in TRL's trainer constructor; kept where that constructor
    # refuses it first: with sync_ref_model, or a streamed dataset
    refused = truthy(settings.get("sync_ref_model", False)) or truthy(settings.get("dataset_streaming", False))
    if truthy(settings.get("precompute_ref_log_probs", False)) and not refused:
        words += ["--precompute_ref_log_probs", "false"]
    vllm = trainers.spec(trainer).generates and truthy(settings.get("use_vllm", False))
    if vllm and (importable("vllm") or not node):  # the engine cannot start here; TRL refuses a missing package first
        words += ["--use_vllm", "false"]
    return words


def swaps(batch: Batch) -> list[str]:
    """What the rehearsal ran in place of what needs a GPU or the network, in words."""
    words = batch.substitute
    own = words[words.index("--dataset_name") + 1] != str(Path(batch.smoke[2]) / "data")
    out = [f"tiny {batch.smoke[0]} model" + (", the --data file's first rows" if own else " and data")]
    if "--attn_implementation" in words:
        out.append("SDPA attention")
    if "--use_liger_kernel" in words:
        out.append("no Liger")
    if "--use_vllm" in words:
        out.append("no vLLM engine")
    if "--precompute_ref_log_probs" in words:
        out.append("reference log-probs not precomputed")
    if "--load_in_4bit" in words or "--load_in_8bit" in words:
        out.append("the checkpoint's bitsandbytes quantisation applied to it")
    if batch.quantized:
        out.append("4-bit weights quantised on CPU")
    return out


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Values of a role's argv that cannot change its outcome, keyed as placeholders so that a relaunch (a new run id, so a
# new output_dir) or a new cluster on the same shared home (new IPs) finds its rehearsal cached: the rendezvous address
# only reaches MASTER_ADDR, which nothing rehearsed connects to, and the run's output_dir when substitutions override it
# (later flags win).
def _keyed(argv: list[str], substitute: list[str]) -> list[str]:
    unkeyed = {"--main_process_ip"} | ({"--output_dir"} if "--output_dir" in substitute else set())
    return ["<unkeyed>" if i and argv[i - 1] in unkeyed else word for i, word in enumerate(argv)]


def cache_key(batch: Batch, workdir: Path) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([batch.trainer, batch.devices, batch.smoke, batch.substitute, batch.bitsandbytes,
                              versions()] + ([True] if batch.nvme else [])).encode())  # fmt: skip
    if batch.capability and tuple(batch.capability) != DEFAULT_CAPABILITY:  # the default's key is the unnamed GPU's
        digest.update(json.dumps(list(batch.capability)).encode())
    for role in batch.roles:
        digest.update(json.dumps([_keyed(role.argv, batch.substitute), role.env, role.role]).encode())
        for content in configs.files_named(role.argv, workdir):
            digest.update(hashlib.sha256(content).digest())
    for source in sorted(Path(__file__).resolve().parent.parent.rglob("*.py")):  # orch's own code
        digest.update(source.read_bytes())
    return digest.hexdigest()[:24]


def _cache_dir() -> Path:
    return home.cache_dir() / "rehearsals"


def output_dir() -> str:
    """Where rehearsed trainers' TrainingArguments point (never the run's CHECKPOINT_ROOT); fixed, so that the
    substitutions, and the cache key, are the same from one rehearsal to the next."""
    return str(_cache_dir() / "output")


def rehearse_batches(batches: list[Batch], workdir: Path = Path("."), parallel: int = 1) -> list[list[Outcome]]:
    """Every role of every batch, in one subprocess; cached results are reused, new ones stored."""
    keys = [cache_key(b, workdir) for b in batches]
    results: list[list[Outcome] | None] = []
    for key in keys:
        path = _cache_dir() / f"{key}.json"
        results.append([Outcome(*o) for o in json.loads(path.read_text())] if path.is_file() else None)
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        fresh = _run([batches[i] for i in todo], workdir, parallel)
        for i, outcomes in zip(todo, fresh, strict=True):
            results[i] = outcomes
            if all(o.stage != "rehearsal" for o in outcomes):  # a crash of the rehearsal itself is not cached
                _cache_dir().mkdir(parents=True, exist_ok=True)
                part = _cache_dir() / f"{keys[i]}.json.{os.getpid()}"  # whole or absent for a concurrent reader
                part.write_text(json.dumps([list(o) for o in outcomes]))
                os.replace(part, _cache_dir() / f"{keys[i]}.json")
    done = [r for r in results if r is not None]  # every batch: from the cache or rehearsed just now
    return [[o._replace(facts={**o.facts, "cached": i not in todo}) for o in r] for i, r in enumerate(done)]


def _run(batches: list[Batch], workdir: Path, parallel: int) -> list[list[Outcome]]:
    request = {
        "process_env": PROCESS_ENV,
        "parallel": parallel,
        "batches": [
            {
                "trainer": b.trainer,
                "devices": b.devices,
                "capability": list(b.capability or DEFAULT_CAPABILITY),
                "smoke": list(b.smoke),
                "bitsandbytes": b.bitsandbytes,
                "nvme": b.nvme,
                "roles": [
                    {"argv": list(r.argv), "env": dict(r.env), "role": r.role, "substitute": b.substitute}
                    for r in b.roles
                ],
            }  # fmt: skip
            for b in batches
        ],
    }
    # its own process group: the roles it forks go with it when this process is stopped (Ctrl-C, SIGTERM: the
    # setup stopping the rehearsal because the download failed first)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.rehearsal.role"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env={**os.environ, **PROCESS_ENV},
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(request))
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    lines = {}
    for line in result.stdout.splitlines():
        if line.startswith("ORCH_REHEARSAL "):
            _, where, payload = line.split(" ", 2)
            lines[where] = json.loads(payload)
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
    out = []
    for i, batch in enumerate(batches):
        outcomes = []
        for j, role in enumerate(batch.roles):
            data = lines.get(f"{i}.{j}")
            if data is None:
                why = f"the rehearsal process failed (exit {result.returncode}): {tail[0]}"
                outcomes.append(Outcome(role.name, False, {}, "rehearsal", why))
            else:
                outcomes.append(Outcome(role.name, data["ok"], data.get("facts", {}), data.get("stage", ""),
                                        data.get("error", "")))  # fmt: skip
        out.append(outcomes)
    return out


def roles_batch(
    trainer: str, roles_: list[Role], substitute: list[str], devices: int, smoke: tuple[str, str, str] | None = None
) -> Batch:
    """The batch rehearse_roles rehearses: without smoke artifacts named, the trainer's own."""
    return Batch(trainer, roles_, substitute, devices, smoke or ("", trainer, ""))


def rehearse_roles(trainer: str, roles_: list[Role], substitute: list[str], devices: int, workdir: Path = Path("."),
                   smoke: tuple[str, str, str] | None = None) -> list[Outcome]:  # fmt: skip
    """The roles of one launch (smoke: the tiny artifacts the substitutions name, built when missing)."""
    return rehearse_batches([roles_batch(trainer, roles_, substitute, devices, smoke)], workdir)[0]


def summary(outcomes: list[Outcome], ranks: int, batch: Batch) -> str:
    """One line: what was rehearsed and what the owners' code made of it."""
    head = outcomes[0].facts
    what = [head.get("distributed_type", "?")]
    if head.get("parallelism"):
        sizes = {k: v for k, v in head["parallelism"].items() if v > 1}
        what.append(" x ".join(f"{k} {v}" for k, v in sizes.items()))
    if head.get("zero_stage") is not None:
        what.append(f"ZeRO-{head['zero_stage']}")
    what.append(f"accumulation {head.get('gradient_accumulation_steps', '?')}")
    if head.get("trainable_params") is not None:
        four = f", {head['linear4bit']} Linear4bit base layers" if head.get("linear4bit") else ""
        what.append(f"{head['trainable_params']:,} trainable adapter parameters{four}")
    if head.get("rewards"):
        what.append(f"reward functions called: {', '.join(name.rsplit('.', 1)[-1] for name in head['rewards'])}")
    if head.get("liger"):
        what.append("Liger's kernels applied")
    what.append(f"final model: {head.get('final_model', '?')}")
    stack = ", ".join(f"{k} {v}" for k, v in versions().items() if k in ("accelerate", "trl", "transformers"))
    cached = " (cached)" if all(o.facts.get("cached") for o in outcomes) else ""
    swapped = swaps(batch) + ([head["nvme_offload"]] if head.get("nvme_offload") else [])
    return (
        f"rehearsed {len(outcomes)} role(s) of {ranks} rank(s) with {stack}: {', '.join(what)}; "
        f"swapped here: {', '.join(swapped)}{cached}"
    )
