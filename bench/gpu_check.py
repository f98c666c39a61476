"""`make gpu-check`: what only a GPU shows, on whatever CUDA GPUs this machine has.

1. Each strategy's smoke recipe through `orch node` exactly as on a cloud node (ORCH_DEVICE=gpu: the recipe's own
   Accelerate config, NCCL, bf16, the recipe's attention and Liger settings where their packages are installed,
   else said), on the tiny model of its family: 8 steps with a checkpoint at 4 and 8, a second start that must
   resume from checkpoint-8 and train to step 12, and the final model loaded back by transformers. One line per
   strategy, read from the ranks' reports (orchestrator/train/entry.py), never from the configs, with rank 0's GPU
   peak from the model's load to the end of accelerate's prepare (its CUDA allocator) beside the memory model's
   per-GPU figure at load (core/load_memory.at_load) for the same model and shape. QLoRA (4-bit, FSDP2) is one of them.
   The `load` part runs QLoRA, ZeRO-3 and DDP (one of each loading path) again on the smoke model's config scaled to
   ~243M parameters (SCALED, random weights, 464 MiB in bf16), where the GPU peak at load can tell the model's terms
   apart, which the tiny models' (under 3 MiB) cannot.
2. Throughput of the SFT recipe's settings (bf16, Liger, padding-free, activation checkpointing) on a real-size
   architecture with random weights (Qwen2.5-0.5B's shapes from its config, sequence 2048) beside TRL's defaults
   on the same model and data: tokens/s, model FLOPs utilisation and the ratio.
3. Packed attention: one packed row of four documents against the same documents unpacked, on the tiny Qwen3 in
   bf16 with flash_attention_2 (the varlen kernel that keeps documents apart from position_ids, which Ulysses relies
   on once it drops the mask; tests/ulysses_packing.py, whose CPU run in tests/test_packed_attention.py shows SDPA
   mixing them under Ulysses). Without the flash-attn package, the recipes' kernels-community/flash-attn2 where it
   loads (PyTorch's FlashAttention stand-in included, below), else SDPA on the block mask transformers builds from
   position_ids, said as such (flash_kernel).

4. The head node's memory check reads the GPUs' memory from nvidia-smi: printed beside CUDA's figure.
5. TRL's fused LM head on CUDA (its Triton fold, TRL's own tile) at Llama-3-8B's head shape: the CUDA allocator's
   peak over one forward and backward beside the memory model's term (core/memory.lm_head), trained and frozen
   (tests/test_lm_head_memory.py measures the torch fold on CPU, with a smaller tile).

Nothing here is simulated: without a CUDA GPU it says so in one line and exits 2. Results go to docs/gpu.md by
hand, with the versions and the date it printed.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STRATEGIES = {  # label -> a shipped recipe that asks for it
    "FSDP2": "phi3_dpo_fsdp",
    "ZeRO-3": "llama3_sft_zero3",
    "ZeRO-2": "qwen25_dpo_zero2",
    "ZeRO-1": "qwen3_sft_zero1",
    "DDP": "qwen25_sft_ddp",
    "QLoRA": "llama3_70b_qlora_fsdp",  # 4-bit NF4 on FSDP2: every rank quantises the whole model onto its GPU
}
LOADING = ("QLoRA", "ZeRO-3", "DDP")  # the `load` part: one of each loading path, on a model of ~243M parameters
PARTS = ("memory", *STRATEGIES, "load", "throughput", "packed", "head")  # `gpu_check.py PART...`: this order
# The `load` part's model: the smoke model's own config (family, tokenizer, vocabulary) at these sizes, random weights:
# large enough (464 MiB in bf16) that the GPU peak at load tells the memory model's terms apart.
SCALED = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64)  # fmt: skip
SEQ = 2048
FLASH_HUB = "kernels-community/flash-attn2"  # what the recipes ask for (transformers' fallback for flash_attention_2)
STANDIN = ROOT / "bench" / "torch_flash"  # PyTorch's FlashAttention kernels behind flash-attn's API (its docstring)
STANDIN_NOTE = "PyTorch's FlashAttention stand-in"  # on every line that ran on it
# bf16 dense peak (TFLOP/s, without sparsity) from the vendors' datasheets; orch's accelerator table comes later.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
# Qwen2.5-0.5B's published config (shapes only; weights are random).
QWEN25_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 x layers x hidden x seq for attention (PaLM's
    appendix B formula; activation recomputation is not counted, as MFU conventionally does not)."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq


def mfu(tokens_per_s: float, per_token_flops: float, gpus: int, peak_tflops: float) -> float:
    return tokens_per_s * per_token_flops / (gpus * peak_tflops * 1e12)


def peak_for(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name.upper():
            return value
    return None


# ---------------------------------------------------------------- 1. strategies


def _gpu_overrides(launch, artifacts) -> tuple[dict[str, str], list[str]]:
    """Smoke's model, data and length, with the recipe's GPU settings kept where the packages exist."""
    from orchestrator.core import smoke

    out = smoke.trl_overrides(artifacts)
    said = []
    out.update(dtype="bfloat16", bf16="true", save_total_limit="3")
    attn, why = _attention(str(launch.setting("attn_implementation", "sdpa")))
    if why:
        said.append(why)
    out["attn_implementation"] = attn
    if attn == FLASH_HUB and standing_in():
        said.append(f"{FLASH_HUB}: {STANDIN_NOTE}")
    liger = str(launch.setting("use_liger_kernel", False)).lower() == "true"
    if liger and importlib.util.find_spec("liger_kernel") is None:
        said.append("Liger asked, liger_kernel not installed: off")
        liger = False
    out["use_liger_kernel"] = str(liger).lower()
    out["gradient_checkpointing"] = str(launch.setting("gradient_checkpointing", False)).lower()
    return out, said


def _attention(asked: str) -> tuple[str, str]:
    """The recipe's attention where this machine can load it as a rank would (the flash-attn package, or a Kernels Hub
    kernel already in the Hugging Face cache: gpu-check runs offline, HF_HUB_OFFLINE=1), else sdpa and why."""
    from orchestrator.core.errors import OrchError
    from orchestrator.train import attention_kernel

    try:
        kernel = attention_kernel.repo(asked)
        if kernel is not None:
            attention_kernel.fetch(kernel, asked, allow_all=False)
    except attention_kernel.NotCached:
        return "sdpa", f"{asked} asked, its kernel is not in this machine's Hugging Face cache: sdpa"
    except OrchError as exc:
        return "sdpa", f"{asked} asked, not loadable here ({str(exc).split(':')[0]}): sdpa"
    return asked, ""


def standing_in() -> bool:
    """Whether flash_standin pointed the kernels package at bench/torch_flash for this run."""
    return os.environ.get("LOCAL_KERNELS") == f"{FLASH_HUB}={STANDIN}"


def flash_kernel() -> tuple[str, str]:
    """The flash attention this machine runs and what its lines say of it: the flash-attn package's
    flash_attention_2, else the recipes' FLASH_HUB where it loads (STANDIN_NOTE when flash_standin serves it), else
    sdpa and why."""
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", ""
    if _attention(FLASH_HUB)[1] == "":
        return FLASH_HUB, STANDIN_NOTE if standing_in() else ""
    return "sdpa", "no flash kernel here: neither the flash-attn package nor the recipes' Hub kernel"


def flash_standin(torch) -> str:
    """Where the recipes' `kernels-community/flash-attn2` cannot load here (no flash-attn package, no route to the Hub:
    the lent machine), serve it from PyTorch's own FlashAttention kernels (bench/torch_flash) through the kernels
    package's LOCAL_KERNELS override, so the strategies, the throughput and the packed-attention check take
    transformers' whole flash path on a flash kernel, not sdpa. Only after its self-test on this GPU passes: a packed
    pair of documents, forward and backward, against SDPA's math in fp32 on each document alone. One line says which."""
    if os.environ.get("LOCAL_KERNELS"):
        return f"attention: LOCAL_KERNELS is set here ({os.environ['LOCAL_KERNELS'][:200]}): used as given"
    attn, why = _attention(FLASH_HUB)
    if not why:
        return f"attention: {FLASH_HUB} loads here: the recipes' own kernel, no stand-in"
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"attention: {why}; torch {torch.__version__} has no torch.nn.attention.varlen to stand in for it"
    sys.path.insert(0, str(STANDIN.parent))
    import torch_flash

    worst = _standin_selftest(torch, torch_flash)
    if not worst < 2e-2:
        return f"attention: stand-in FAILED its self-test here (max |diff| {worst:.1e} against fp32 math): sdpa"
    os.environ["LOCAL_KERNELS"] = f"{FLASH_HUB}={STANDIN}"
    return (
        f"attention: {FLASH_HUB} (not loadable here) stood in by {torch_flash.KERNEL}, bench/torch_flash through "
        f"kernels' LOCAL_KERNELS; self-test on this GPU: max |diff| {worst:.1e} (outputs and gradients, bf16) against "
        "SDPA's math in fp32, document by document"
    )


def _standin_selftest(torch, kernel, device: str = "cuda") -> float:
    """The largest |difference| of the stand-in's varlen and dense outputs and input gradients (causal, grouped-query,
    two packed documents of 96 and 32 tokens, bf16 on `device`) from SDPA's math kernel on each document alone in
    fp32 from the same values: the stand-in's rounding only, gradients relative to their scale."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(128, h, 64, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (8, 2, 2))  # fmt: skip
    cu = torch.tensor([0, 96, 128], device=device, dtype=torch.int32)
    out = kernel.flash_attn_varlen_func(q, k, v, cu, cu, 96, 96, causal=True)
    dense = kernel.flash_attn_func(q[None, :96], k[None, :96], v[None, :96], causal=True)[0]
    grads = torch.autograd.grad(out.float().square().sum() + dense.float().sum(), (q, k, v))
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    refs = []
    for a, b in ((0, 96), (96, 128)):
        qq, kk, vv = (t[a:b].transpose(0, 1)[None] for t in exact)
        kk, vv = kk.repeat_interleave(4, dim=1), vv.repeat_interleave(4, dim=1)
        with sdpa_kernel(SDPBackend.MATH):
            refs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1))
    ref = torch.cat(refs)
    ref_grads = torch.autograd.grad(ref.square().sum() + refs[0].sum(), exact)
    diffs = [(out.float() - ref).abs().max(), (dense.float() - refs[0]).abs().max()]
    for g, r in zip(grads, ref_grads, strict=True):  # relative to the gradient's scale
        diffs.append((g.float() - r).abs().max() / max(1.0, r.abs().max().item()))
    return max(d.item() for d in diffs)


def _node(envs: dict[str, str], gpus: int, task_id: str, work: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        **envs,
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1\n",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        "SKYPILOT_TASK_ID": task_id,
        "ORCH_DEVICE": "gpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "orchestrator", "node"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)


def _first_error(result: subprocess.CompletedProcess) -> str:
    text = result.stdout + result.stderr
    for line in text.splitlines():  # orch's own one line (node/run.py) quotes the rank's first real error
        if line.startswith("[orch] failed"):
            return line.strip()[:400]
    for line in text.splitlines():
        if re.search(r"(Error|error:|Exception)\b", line) and "Warning" not in line:
            return line.strip()[:300]
    return (text.strip().splitlines() or ["(no output)"])[-1][:300]


def scaled_model(smoke_model: Path, work: Path) -> Path:
    """The smoke model's config at SCALED's sizes, random weights in bf16, beside its tokenizer files: built once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / f"scaled-{smoke_model.parent.name}"
    if (out / "config.json").is_file():
        return out
    config = json.loads((smoke_model / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("layer_types", "max_window_layers")}  # per-layer lists
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**config, **SCALED}),
                                             dtype=torch.bfloat16)  # fmt: skip
    model.save_pretrained(out)
    for f in smoke_model.iterdir():
        if f.is_file() and not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def check_strategy(label: str, recipe_name: str, gpus: int, work: Path, scaled: bool = False) -> str:
    from orchestrator.core import overrides, smoke
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.resolved import resolve

    launch = resolve(recipes.load(recipe_name))
    artifacts = smoke.plan(str(launch.setting("model_name_or_path", "")), launch.trainer)
    smoke.ensure(artifacts)
    trl, said = _gpu_overrides(launch, artifacts)
    if scaled:
        trl["model_name_or_path"] = str(scaled_model(artifacts.dir / "model", work))
    tag = recipe_name + ("-scaled" if scaled else "")  # its output, logs and task id apart from the smoke model's
    out_dir = work / tag
    trl["output_dir"] = str(out_dir)
    envs = {k: str(v) for k, v in launch.envs.items()}
    # smoke's global batch; the scaled model's runs one micro-batch per GPU and step (16 took 5 s a step on an H100)
    envs["GLOBAL_BATCH_SIZE"] = str(gpus) if scaled else "16"
    envs.pop("CHECKPOINT_ROOT", None)  # no bucket here: output_dir above
    started = time.monotonic()
    first = _node({**envs, "TRL_OVERRIDES": overrides.dumps(trl)}, gpus, f"gpu-check-{tag}", work)
    (work / f"{tag}.log").write_text(first.stdout + first.stderr)  # the whole of it, for a failure's cause
    if first.returncode != 0:
        return f"{label:7} ({recipe_name}): FAILED: {_first_error(first)}"
    # the fresh start's report: the resume rewrites rank0.json, and its prepare also loads the checkpoint's states
    fresh = json.loads((out_dir / "orch" / "rank0.json").read_text())
    second = _node(
        {**envs, "TRL_OVERRIDES": overrides.dumps({**trl, "max_steps": "12"})}, gpus, f"gpu-check-{tag}", work
    )
    (work / f"{tag}-resume.log").write_text(second.stdout + second.stderr)
    if second.returncode != 0:
        return f"{label:7} ({recipe_name}): trained, then the resume FAILED: {_first_error(second)}"
    report = json.loads((out_dir / "orch" / "rank0.json").read_text())
    resumed = report.get("resumed_from") or "nothing"
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if launch.trainer == "reward" else AutoModelForCausalLM
    model = auto.from_pretrained(out_dir)
    facts = report.get("strategy") or {}
    sharded = f", {facts['sharded_params']}/{facts['params']} params sharded" if "params" in facts else ""
    log = [json.loads(x) for x in (out_dir / "orch" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    dtypes = "/".join((report.get("final_model") or {}).get("dtypes") or ["?"])
    return (
        f"{label:7} ({recipe_name}): {report['distributed_type']} over {report['backend']} on {report['device']}, "
        f"{report['world_size']} GPU(s), attention {report.get('attention')}, liger asked "
        f"{trl['use_liger_kernel']}{sharded}; resumed from "
        f"{Path(resumed).name} to step {report['optimizer_steps']}, last loss {losses[-1]:.4f}; final model "
        f"loads ({model.num_parameters():,} params, {dtypes}); {load_figures(recipe_name, trl, gpus, fresh)}; "
        f"{resume_peak(report)}; "
        f"{time.monotonic() - started:.0f} s" + (f" [{'; '.join(said)}]" if said else "")
    )


def _gpu_peaks(report: dict) -> dict[str, float]:
    """Rank 0's GPU peak (MiB) in each phase train/loading.py marks: the model's load, its build (PEFT) and the
    prepare (accelerate's, and on a resume the checkpoint's states), each from the end of the one before."""
    phases = {p: report.get("host_memory", {}).get(p) or {} for p in ("load", "build", "prepare")}
    return {p: phase["gpu_peak"] / 2**20 for p, phase in phases.items() if "gpu_peak" in phase}


def resume_peak(report: dict) -> str:
    """The resumed start's GPU peak to its first step: its prepare also loads the checkpoint (optimizer states
    included), which load_memory.at_load, a fresh start's figure, does not count."""
    peaks = _gpu_peaks(report)
    return f"resumed start's GPU peak {max(peaks.values()):,.1f} MiB" if peaks else "resumed start's peak not measured"


def load_figures(recipe_name: str, trl: dict[str, str], gpus: int, report: dict) -> str:
    """A fresh start's rank 0 GPU peak from the load to the end of accelerate's prepare, per phase, beside
    load_memory.at_load's per-GPU figure for the recipe with these overrides on `gpus` GPUs."""
    from orchestrator.launch import preflight
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.resolved import resolve

    peaks = _gpu_peaks(report)
    each = ", ".join(f"{p} {v:,.1f}" for p, v in peaks.items())
    measured = f"GPU at load {max(peaks.values()):,.1f} MiB ({each})" if peaks else "GPU at load not measured"
    launch = resolve(recipes.load(recipe_name), trl_overrides=trl)
    setup = preflight.setup_of(launch, gpus)
    if setup is None:
        return f"{measured} (no model figure: orch has no shape for the smoke model)"
    model = preflight.at_load(setup, gpus, launch.paired.accelerate)
    return f"{measured} (model {model.gpu / 2**20:,.1f} MiB: {model.path.split(':')[0]})"


# ---------------------------------------------------------------- 2. throughput


def throughput(settings: str, steps: int = 12, warmup: int = 3) -> dict:
    """Tokens/s of one SFT configuration on Qwen2.5-0.5B's shapes (random weights), measured on this process's GPU
    over `steps` optimizer steps after `warmup`; tokens exclude padding (counted from the attention masks)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from orchestrator.core import smoke

    torch.cuda.reset_peak_memory_stats()  # this configuration's peak, not the process's (the other ran before it)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    artifacts = smoke.plan("Qwen/Qwen2.5-0.5B", "sft")
    smoke.ensure(artifacts)
    tokenizer = AutoTokenizer.from_pretrained(artifacts.dir / "model")
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(SEQ // 8, SEQ, (256,), generator=rng).tolist()  # ragged, as real chat data
    rows = [{"input_ids": torch.randint(0, config.vocab_size, (n,), generator=rng).tolist()} for n in lengths]
    data = Dataset.from_list(rows)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="gpu-check-"), max_steps=steps + warmup, per_device_train_batch_size=4,
        logging_steps=1, report_to="none", save_strategy="no", max_length=SEQ, disable_tqdm=True,
    )  # fmt: skip
    if settings == "recipe":  # recipes/trl/qwen25_sft.yaml's speed settings: bf16, packing (padding-free), Liger,
        # activation checkpointing, its flash attention (the flash-attn package, the Hub kernel, or the stand-in)
        args = SFTConfig(
            **common, bf16=True, packing=True, gradient_checkpointing=True,
            use_liger_kernel=importlib.util.find_spec("liger_kernel") is not None,
        )  # fmt: skip
        asked, note = flash_kernel()
        model.set_attn_implementation(asked)
    else:  # TRL's defaults (weights in bf16 for both, as loaded)
        args = SFTConfig(**common)
        note = ""

    class Clock(TrainerCallback):
        tokens = 0
        start = None

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == warmup and self.start is None:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

    clock = Clock()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[clock])
    counted = {"tokens": 0}
    original = trainer.compute_loss

    def compute_loss(model, inputs, *a, **kw):
        if trainer.state.global_step >= warmup:
            mask = inputs.get("attention_mask")
            counted["tokens"] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        return original(model, inputs, *a, **kw)

    trainer.compute_loss = compute_loss
    trainer.train()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - clock.start
    attention = model.config._attn_implementation  # what the model runs, read back
    tps = counted["tokens"] / elapsed
    peak = peak_for(torch.cuda.get_device_name(0))
    per_token = flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, SEQ)
    result = {
        "settings": settings,
        "tokens_per_s": tps,
        "mfu": mfu(tps, per_token, 1, peak) if peak else None,
        "params": n_params,
        "memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "liger": bool(getattr(args, "use_liger_kernel", False)),
        "attention": attention + (f" ({note})" if note and attention == FLASH_HUB else ""),
    }
    trainer = model = None  # the next configuration's peak starts from nothing of this one (gc: the cycle)
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str]) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"  # as the ranks run it (_node): nothing is downloaded here
    parts = argv[1:] or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"gpu-check: error: unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("gpu-check: error: torch is not installed here; run `make install` first", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print(
            "gpu-check: error: no CUDA GPU on this machine (torch.cuda.device_count() is 0, torch "
            f"{torch.__version__}); run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    import accelerate
    import transformers
    import trl

    name = torch.cuda.get_device_name(0)
    print(
        f"gpu-check {time.strftime('%Y-%m-%d')}: {gpus} x {name}, torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), transformers {transformers.__version__}, trl {trl.__version__}, accelerate "
        f"{accelerate.__version__}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="orch-gpu-check-"))
    print(f"gpu-check: runs and their logs in {work}", flush=True)
    failed = []
    if any(p in STRATEGIES or p in ("load", "throughput", "packed") for p in parts):
        line = flash_standin(torch)
        print(line, flush=True)
        failed += ["attention"] if "FAILED" in line else []
    for part in parts:  # one part's failure is said and the others still run: GPU time is scarce
        started = time.monotonic()
        try:
            for line in part_lines(part, torch, gpus, work):  # each as it comes: a lease can end mid-part
                failed += [part] if "FAILED" in line or "DIFFERS" in line or "MIXED" in line else []
                print(line, flush=True)
        except Exception as exc:  # noqa: BLE001 - said with its part, then the next part
            print(f"{part}: FAILED after {time.monotonic() - started:.0f} s: {type(exc).__name__}: {str(exc)[:300]}",
                  flush=True)  # fmt: skip
            failed.append(part)
    if failed:
        print(f"gpu-check: {len(set(failed))} part(s) failed: {', '.join(dict.fromkeys(failed))}", flush=True)
        return 1
    return 0


def part_lines(part: str, torch, gpus: int, work: Path):
    """The lines of one part, as each is made."""
    if part == "memory":
        yield node_gpu_memory(torch)
    elif part in STRATEGIES:
        yield check_strategy(part, STRATEGIES[part], gpus, work)
    elif part == "load":
        for label in LOADING:
            yield check_strategy(label, STRATEGIES[label], gpus, work, scaled=True)
    elif part == "throughput":
        yield from throughput_lines()
    elif part == "packed":
        yield packed_attention(work)
    else:
        yield lm_head_memory(torch)


def throughput_lines() -> list[str]:
    base = throughput("trl-defaults")
    ours = throughput("recipe")
    lines = []
    for r in (base, ours):
        mfu_text = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU n/a (GPU not in the peak table)"
        lines.append(
            f"throughput {r['settings']:12}: {r['tokens_per_s']:,.0f} tokens/s (padding excluded), {mfu_text}, "
            f"peak memory {r['memory_gb']:.1f} GB, attention {r['attention']}, liger {r['liger']} "
            f"(Qwen2.5-0.5B shapes, {r['params'] / 1e6:.0f}M params, random weights, seq {SEQ})"
        )
    lines.append(f"throughput ratio recipe / trl-defaults: {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    return lines


def lm_head_memory(torch, vocab: int = 128256, hidden: int = 4096, tokens: int = 8192, device: str = "cuda") -> str:
    """TRL's fused LM head, one forward and backward under bf16 autocast, its allocator peak (over what was allocated
    before) beside core/memory.lm_head's figure less the scored hidden states' copy, which its caller makes."""
    from orchestrator.core import memory

    said = []
    for trained in (True, False):
        peak = head_peak(torch, trained, vocab, hidden, tokens, device)
        parts = memory.lm_head(tokens, vocab, hidden, trained=trained)
        counted = sum(parts.values()) - parts["scored hidden states"]  # the caller's copy, not the function's
        verdict = "within 10%" if abs(peak - counted) <= 0.1 * counted else "DIFFERS by more than 10%"
        said.append(f"{'trained' if trained else 'frozen'} head: CUDA peak {peak / 2**30:.2f} GiB, the model "
                    f"{counted / 2**30:.2f} GiB ({peak / counted:.2f}x, {verdict})")  # fmt: skip
    return f"fused LM head (TRL's Triton fold; {vocab} x {hidden}, {tokens} tokens, bf16): " + "; ".join(said)


def head_peak(torch, trained: bool, vocab: int, hidden: int, tokens: int, device: str) -> int:
    """One case's peak over what was allocated before it, in a scope of its own: everything it made is gone when it
    returns. (Its first GPU run kept the function's other outputs, `log_probs, *_ = ...`, past the case: the trained
    head's entropy held its autograd graph, and with it the 1 GiB weight and its gradient, until the frozen case's
    forward rebound `_`; the frozen case's backward then ran in the memory just freed, and its peak read 0.25 GiB.)"""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    cuda = device == "cuda"
    torch.manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_(trained)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    with torch.autocast(device, dtype=torch.bfloat16):
        outputs = ChunkedLogProbFunction.apply(hidden_states, weight, None, labels, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                               None, 1.0, ("log_probs", "entropy", "is_top1"))  # fmt: skip
    outputs[0].sum().backward()
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    del outputs, hidden_states, weight, labels
    if cuda:
        torch.cuda.empty_cache()
    return peak


def node_gpu_memory(torch) -> str:
    """What the head node's memory check (orchestrator/node/memory.py) reads from nvidia-smi, beside what CUDA reports
    for the same GPU: they must agree, or the check measures the wrong thing."""
    from orchestrator.node import memory

    seen = memory.gpu_memory()
    cuda = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / 2**30
    if seen is None:
        return f"node memory check: nvidia-smi gave nothing (CUDA: {cuda:.2f} GiB): the check would say GPU unchecked"
    gib, name = seen
    agree = "agree" if abs(gib - cuda) <= 0.05 * cuda else "DISAGREE"
    return f"node memory check: nvidia-smi {gib:.2f} GiB ({name}), CUDA {cuda:.2f} GiB: {agree}"


def packed_attention(work: Path) -> str:
    """The packed row's loss against the unpacked documents' on a flash kernel (one GPU, bf16): equal within bf16's
    rounding when the kernel keeps the documents apart. The flash-attn package's flash_attention_2 where installed,
    else the recipes' kernels-community/flash-attn2 where it loads (flash_standin's PyTorch stand-in included), else
    SDPA on the block mask transformers builds from position_ids (not a flash kernel), said as such."""
    attention, note = flash_kernel()
    said = f" [{note}]" if note else ""
    from orchestrator.core import smoke

    artifacts = smoke.plan("Qwen/Qwen3-8B", "sft")  # the tiny Qwen3, built here
    smoke.ensure(artifacts)
    model = artifacts.dir / "model"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                          str(ROOT / "tests" / "ulysses_packing.py"), str(model), attention],
                         cwd=work, capture_output=True, text=True, timeout=600)  # fmt: skip
    found = re.search(r"^LOSSES (.*)$", run.stdout, re.M)
    if run.returncode or not found:
        return f"packed attention {attention}: FAILED: {_first_error(run)}"
    losses = json.loads(found.group(1))
    gap, mixed = (abs(losses[k] - losses["unpacked"]) for k in ("packed_no_sp", "packed_mixed"))
    verdict = "documents kept apart" if gap < mixed / 4 else "documents MIXED"
    return (
        f"packed attention {attention}: packed {losses['packed_no_sp']:.4f} vs unpacked {losses['unpacked']:.4f} "
        f"(|diff| {gap:.1e}; {mixed:.1e} when every document attends to the ones before it, bf16): {verdict}{said}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
