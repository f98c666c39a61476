"""`orch plan MODEL`: for each accelerator orch knows, the fewest 8-GPU nodes and the strategy that fit, with $/h."""

from __future__ import annotations

import argparse
import functools

from orchestrator.commands import add
from orchestrator.core import optimizers, trainers

EPILOG = """\
examples:
  orch plan meta-llama/Llama-3.1-70B-Instruct --trainer sft --max-length 4096
  orch plan meta-llama/Llama-3.1-8B-Instruct --peft lora --batch 4 --max-length 2048
  orch plan meta-llama/Llama-3.1-70B-Instruct --peft qlora --nested-quant
  orch plan Qwen/Qwen3-8B --trainer grpo --batch 4 --vllm-colocate 0.3   # vLLM holds 0.3 of every GPU
  orch plan Qwen/Qwen3-8B --max-length 32768 --cp 2      # each sequence split over 2 GPUs (FSDP2's context parallelism)
  orch plan ./my-model/config.json --trainer dpo        # any decoder model's config.json
  orch plan Qwen/Qwen2.5-7B-Instruct --peft lora         # any other Hub model: its config.json, read from the Hub

The estimate (orchestrator/core/memory.py, docs/design/memory.md) counts weights, gradients, optimizer states,
activations, TRL's fused LM head, the reference model and the CUDA context; tests check it against published
measurements and against TRL's own code.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "plan",
        help="which accelerators and how many nodes a model's training needs, and what they cost",
        description="Estimate per-GPU memory for training MODEL and list, for each accelerator, the fewest nodes and "
        "the strategy that fit, with SkyPilot's $/h where its catalog is on this machine.",
        epilog=EPILOG,
    )
    parser.add_argument("model", help="a Hugging Face model id (its config.json is read from the Hub), or a model's "
                        "config.json (or its directory)")
    parser.add_argument("--trainer", default="sft", choices=trainers.TRAINERS, help="the TRL trainer (default: sft)")
    parser.add_argument("--max-length", type=int,
                        help="tokens per sequence (TRL's max_length: 1024); not for grpo/rloo, which keep prompts "
                        "whole")
    parser.add_argument("--max-completion-length", type=int,
                        help="grpo/rloo: tokens generated per prompt (TRL's max_completion_length: 512); prompts are "
                        "taken as 512 tokens, as the launch check takes them")
    parser.add_argument("--batch", type=int,
                        help="per-device micro-batch, in sequences (default: the least the trainer takes, 1; KTO 2)")
    parser.add_argument("--beta", type=float,
                        help="grpo/rloo: the KL coefficient; above 0 TRL keeps a frozen reference model (GRPO's "
                        "default 0, RLOO's 0.05)")
    parser.add_argument("--peft", choices=("lora", "qlora"), help="train a LoRA adapter (qlora: on 4-bit weights)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (TRL's default 16)")
    parser.add_argument("--all-linear", action="store_true", help="LoRA on every linear layer, not q_proj/v_proj")
    parser.add_argument("--lora-dropout", type=float, default=0.05,
                        help="LoRA dropout (TRL's 0.05); 0 keeps no dropout masks for the backward")
    parser.add_argument("--no-checkpointing", action="store_true", help="without activation checkpointing")
    parser.add_argument("--attention", default="sdpa", metavar="NAME",
                        help="attn_implementation (default sdpa, transformers' own: a seq x seq mask where a batch is "
                        "padded or packed; eager also every head's scores; flash_attention_2 or a Hub kernel such as "
                        "kernels-community/flash-attn2 neither)")
    parser.add_argument("--packing", choices=("bfd", "wrapped"),
                        help="sft: TRL's packing_strategy (bfd: each micro-batch one padding-free row, as TRL's "
                        "packing: true; wrapped: rows of max_length, unpadded)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype the weights are loaded in (TRL's dtype); float32 plans the GPUs without bf16 "
                        "(T4, V100) for fp16 mixed precision")
    parser.add_argument("--nested-quant", action="store_true", help="QLoRA with nested quantisation")
    parser.add_argument("--vllm-colocate", type=float, metavar="SHARE",
                        help="grpo/rloo generating with vLLM inside each training process (TRL's vllm_mode colocate): "
                        "the share of every GPU's memory it holds (vllm_gpu_memory_utilization; TRL's default 0.3)")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="grpo/rloo without vLLM (use_vllm false): N completions a GPU generates at once with "
                        "transformers' generate (per_device_train_batch_size x steps_per_generation; ZeRO-3 rows "
                        "gather the whole model for it, TRL's ds3_gather_for_generation): each row holds that too")
    parser.add_argument("--vllm-max-len", type=int, metavar="N",
                        help="with --vllm-colocate: vLLM's max_model_len (TRL's vllm_max_model_length; default the "
                        "model's positions, whose KV cache vLLM must hold for one sequence to start)")
    parser.add_argument("--vllm-sleep", action="store_true",
                        help="with --vllm-colocate: vllm_enable_sleep_mode (vLLM frees its share while the trainer "
                        "steps)")  # fmt: skip
    parser.add_argument("--strategy", choices=("ddp", "zero1", "zero2", "zero3", "fsdp"),
                        help="with --gpus: estimate this one configuration, part by part, instead of the table")
    parser.add_argument("--gpus", type=_total_gpus, help="with --strategy: the total number of GPUs (a number: the "
                        "accelerator's memory is not used by this estimate)")  # fmt: skip
    parser.add_argument("--cp", type=int, metavar="N",
                        help="context parallelism over N GPUs (FSDP2; the Accelerate config's "
                        "parallelism_config_cp_size)")
    parser.add_argument("--sp", type=int, metavar="N", help="ALST/Ulysses sequence parallelism over N GPUs (ZeRO-3; "
                        "the Accelerate config's parallelism_config_sp_size)")
    parser.add_argument("--offload", action="store_true", help="with --strategy: CPU offload")
    parser.add_argument("--optim", default=optimizers.DEFAULT_OPTIM, choices=sorted(optimizers.OPTIM_STATES),
                        metavar="NAME", help="TRL's optim: the optimizer states a trained parameter keeps (default "
                        f"{optimizers.DEFAULT_OPTIM}; e.g. adamw_8bit, paged_adamw_8bit, adafactor, lion_8bit, sgd)")
    parser.add_argument("--eval-batch", type=int, metavar="N",
                        help="the run evaluates (eval_strategy) N sequences at a time (per_device_eval_batch_size; "
                        "transformers' default 8): each row holds that evaluation too (grpo, rloo: with --generate, "
                        "its N completions generated at once)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                        help="the table's nodes: N GPUs each (default 8)")  # fmt: skip
    parser.add_argument("--max-nodes", type=int, default=16, metavar="N",
                        help="the table looks for a fit up to N nodes (default 16)")  # fmt: skip
    parser.set_defaults(func=main)


def _total_gpus(text: str) -> int:
    """--gpus N: `orch run`'s TYPE:N form is refused by name (argparse's "invalid int value" said nothing)."""
    try:
        return int(text)
    except ValueError:
        hint = f" (`orch run --gpus {text}` is TYPE:N per node; here, the total: e.g. --gpus 16)" if ":" in text else ""
        raise argparse.ArgumentTypeError(f"{text!r}: give the total number of GPUs{hint}") from None


def main(args: argparse.Namespace) -> int:
    from orchestrator.commands import print_table
    from orchestrator.core import (
        accelerators,
        attention,
        cuda_arch,
        dense_attention,
        disk_need,
        eval_memory,
        generation_memory,
        host_fit,
        load_memory,
        memory,
        models,
        precision,
        vllm_fit,
    )
    from orchestrator.core import fit as fit_rules
    from orchestrator.core.errors import OrchError
    from orchestrator.launch import preflight
    from orchestrator.node import model_config

    for flag in ("max_length", "max_completion_length", "batch", "lora_r", "gpus_per_node", "max_nodes", "gpus", "cp",
                 "sp", "vllm_max_len", "eval_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise OrchError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a positive whole number")
    spec = trainers.spec(args.trainer)
    generates = spec.generates
    if args.batch is None:
        args.batch = spec.min_micro_batch
    elif args.batch < spec.min_micro_batch:  # the node refuses it (node/rules.check_trainer_batch)
        raise OrchError(f"--batch {args.batch}: {args.trainer.upper()} needs per_device_train_batch_size >= "
                        f"{spec.min_micro_batch} ({spec.min_micro_batch_why})")  # fmt: skip
    if generates and args.max_length is not None:
        raise OrchError(f"--max-length: {args.trainer} takes each prompt whole (TRL 1.16 has no max_prompt_length); "
                        f"give --max-completion-length (prompts are taken as {fit_rules.PROMPT_TOKENS} tokens)")
    if not generates and args.max_completion_length is not None:
        raise OrchError(f"--max-completion-length: {args.trainer} does not generate; give --max-length "
                        "(tokens per sequence)")  # fmt: skip
    seq_len, completion = fit_rules.lengths(args.trainer, args.max_length, args.max_completion_length)
    if args.vllm_colocate is not None:
        if not generates:
            raise OrchError(f"--vllm-colocate: {args.trainer} does not generate; vLLM serves grpo and rloo "
                            "(--trainer grpo)")  # fmt: skip
        if not 0 < args.vllm_colocate <= 1:
            raise OrchError(f"--vllm-colocate {args.vllm_colocate:g}: give the share of a GPU's memory vLLM holds, "
                            "above 0 and at most 1 (TRL's default 0.3)")  # fmt: skip
    elif args.vllm_sleep or args.vllm_max_len:
        flag = "--vllm-sleep" if args.vllm_sleep else "--vllm-max-len"
        raise OrchError(f"{flag} goes with --vllm-colocate: e.g. --vllm-colocate 0.3 {flag}")
    if args.generate is not None:
        if not generates:
            raise OrchError(f"--generate: {args.trainer} does not generate; give --trainer grpo or rloo")
        if args.vllm_colocate is not None:
            raise OrchError("--generate and --vllm-colocate: with vLLM, vLLM generates; give one of them")
        if args.generate < 1:
            raise OrchError(f"--generate {args.generate}: give the completions a GPU generates at once, at least 1")
    if args.attention not in dense_attention.NAMED and "/" not in args.attention:
        raise OrchError(f"--attention {args.attention}: give one of {', '.join(dense_attention.NAMED)}, or a Kernels "
                        f"Hub kernel such as {attention.FLASH_KERNEL}")  # fmt: skip
    if args.packing and not spec.padding_free:
        raise OrchError(f"--packing: {args.trainer} does not pack; TRL's sft does (packing: true)")
    if (args.strategy is None) != (args.gpus is None):
        raise OrchError("--strategy and --gpus go together: e.g. --strategy fsdp --gpus 16")
    if args.beta is not None and spec.reference != "beta":
        keeps = "always keeps a reference model" if spec.reference == "always" else "keeps no reference model"
        raise OrchError(f"--beta: {args.trainer} {keeps} whatever its beta; --beta is for grpo and rloo")
    if not 0 <= args.lora_dropout < 1:
        raise OrchError(f"--lora-dropout {args.lora_dropout:g}: give a probability, at least 0 and below 1")
    split, only = 1, fit_rules.STRATEGIES  # the strategies a context- or sequence-parallel run can take
    if args.cp and args.sp:
        raise OrchError("--cp and --sp: accelerate takes one of them; ring attention (cp, FSDP2) or Ulysses (sp, "
                        "ZeRO-3)")  # fmt: skip
    for flag, n, strategy in (("cp", args.cp, "fsdp"), ("sp", args.sp, "zero3")):
        if not n or n == 1:
            continue
        split, only = n, (strategy,)
        if args.strategy not in (None, strategy):
            raise OrchError(f"--{flag} {n} runs under {'FSDP2' if strategy == 'fsdp' else 'ZeRO-3'}: use --strategy "
                            f"{strategy}")  # fmt: skip
        if args.gpus and args.gpus % n:
            raise OrchError(f"--{flag} {n}: --gpus {args.gpus} is not a multiple of {n} (each sequence is split over "
                            f"{n} GPUs)")  # fmt: skip
    found = model_config.read(args.model)  # a Hub model's config.json (its cache first), a local one, or none
    arch = models.arch_of(args.model, found.config, found.where)
    if arch is None:
        raise OrchError(
            f"orch has no shape for {args.model!r} ({found.why}); give its config.json (or the directory holding "
            f"it): orch plan path/to/config.json, known: {', '.join(sorted(models.KNOWN_ARCHS))}"
        )
    base = memory.Setup(
        arch=arch,
        trainer=args.trainer,
        method=args.peft or "full",
        micro_batch=args.batch,
        seq_len=seq_len,
        completion_len=completion,
        checkpointing=not args.no_checkpointing,
        dense_attention=dense_attention.kind(args.attention),
        batch_shape=dense_attention.batch_shape(args.trainer, {"packing": bool(args.packing),
                                                              "packing_strategy": args.packing}),
        lora_r=args.lora_r,
        lora_targets=("all-linear",) if args.all_linear else memory.PEFT_DEFAULT_TARGETS,
        lora_dropout=args.lora_dropout,
        beta=args.beta,
        seq_split=split,
        strategy=only[0] if split > 1 else "fsdp",  # the header's words; each row sets its own
        weights_dtype=args.dtype,
        nested_quant=args.nested_quant,
        vllm_share=args.vllm_colocate or 0.0,
        vllm_sleeps=args.vllm_sleep,
        vllm_max_len=args.vllm_max_len or 0,
        optim=args.optim,
        eval_batch=args.eval_batch or 0,
        generation_rows=args.generate or 0,
        generation_gather=bool(args.generate),  # under ZeRO-3 only (generation_memory.gathers_all)
    )
    what = {"full": "full fine-tune", "lora": f"LoRA r{args.lora_r}", "qlora": f"QLoRA (NF4) r{args.lora_r}"}
    vllm = ""
    if args.vllm_colocate:
        asleep = " while generating (sleep mode)" if args.vllm_sleep else ""
        vllm = f", colocated vLLM holding {args.vllm_colocate:g} of each GPU{asleep}"
    print(
        f"{args.model}: {arch.params / 1e9:.1f}B parameters, {args.trainer} {what[base.method]}"
        f"{' beside a frozen reference model' if memory.has_reference(base) else ''}, "
        f"{fit_rules.tokens_words(base).replace(' per device', ' per GPU')}, activation checkpointing "
        f"{'off' if args.no_checkpointing else 'on'}, attention {args.attention}"
        + (f" ({args.packing} packing)" if args.packing else "") + vllm
        + (f", optim {args.optim}" if args.optim != optimizers.DEFAULT_OPTIM else "")
        + (f", evaluating {args.eval_batch} at a time" if args.eval_batch else "")
        + (f", generating {args.generate} completions at once without vLLM" if args.generate else "")
    )
    if args.strategy:
        one = memory.estimate(memory.with_(base, strategy=args.strategy, gpus=args.gpus, offload=args.offload))
        beside = f", plus colocated vLLM's {args.vllm_colocate:g} of the GPU's memory" if args.vllm_colocate else ""
        print(f"{preflight.label(one.setup)} on {args.gpus} GPU(s): {one.describe()}{beside}")
        if during := eval_memory.estimate(one.setup):
            print(f"evaluating: {during.describe()}")
        if making := generation_memory.estimate(one.setup):
            print(f"generating: {making.describe()}")
        return 0
    per_node = args.gpus_per_node
    from orchestrator.launch import backends

    prices = backends.node_prices(per_node)
    no_bf16: list[str] = []
    no_vllm: list[str] = []
    no_kernels: list[str] = []
    planned: list[tuple[int, memory.Setup]] = []
    rows = [("ACCELERATOR", "NODES", "STRATEGY", "GIB/GPU", "OF", "$/H", "INSTANCE", "FEWER NODES WITH CPU OFFLOAD")]
    for name, capacity in sorted(accelerators.KNOWN_GIB.items(), key=lambda kv: (-kv[1], kv[0])):
        if not cuda_arch.runs_lock(name):  # a launch there is refused (cuda_arch.py): the nodes' torch cannot run
            rows.append((name, "-", "none: no kernels", "", str(capacity), "", "", ""))
            no_kernels.append(name)
            continue
        if args.dtype == "bfloat16" and not precision.native_bf16(name):  # a launch there is refused (precision.py)
            rows.append((name, "-", "none in bf16", "", str(capacity), "", "", ""))
            no_bf16.append(name)
            continue
        try:  # a colocated vLLM engine that cannot start on this GPU, at any node count
            vllm_fit.check_vllm_room(base, capacity, name)
        except OrchError:
            rows.append((name, "-", "none: vLLM's KV cache", "", str(capacity), "", "", ""))
            no_vllm.append(name)
            continue
        usable = capacity * preflight.USABLE_FRACTION
        need = functools.partial(_peak, capacity_gib=capacity)  # with vLLM's share of this GPU, or an evaluation
        fit = fit_rules.smallest_fit(base, usable, per_node, args.max_nodes, need=need, strategies=only)
        price = prices.get(name)
        offload = ""
        if (fit is None or fit.nodes > 1) and "zero3" in only:  # ZeRO-3 offload trades host memory for nodes
            fewer = (fit.nodes - 1) if fit else args.max_nodes
            off = fit_rules.smallest_fit(base, usable, per_node, fewer, offload=True, need=need)
            if off is not None:
                host = host_fit.offloaded_gib(off.estimate.setup, off.nodes)
                offload = f"{off.nodes} x {per_node}: ~{need(off.estimate):.0f} GiB/GPU, ~{host:,.0f} GiB host RAM/node"
        if fit is None:
            one_node = memory.with_(base, gpus=per_node)
            loading = load_memory.at_load(one_node, per_node, cpu_ram_efficient=True).gpu / memory.GIB
            why = f"none: ~{loading:.0f} GiB/GPU while loading" if loading > usable else \
                f"none up to {args.max_nodes} nodes"  # fmt: skip
            rows.append((name, "-", why, "", str(capacity), "", "", offload))
            continue
        planned.append((fit.nodes, fit.estimate.setup))
        dollars = f"{price[0] * fit.nodes:.2f}" if price else "-"
        instance = price[1] if price else ""
        rows.append((name, f"{fit.nodes} x {per_node}", preflight.label(fit.estimate.setup),
                     f"{need(fit.estimate):.1f}", str(capacity), dollars, instance, offload))  # fmt: skip
    print_table(rows)
    if planned:  # checkpoints on a bucket, as the recipes keep them: each node's download and checkpoint share
        sizes = disk_need.per_node_words(sorted(planned, key=lambda p: p[0]), disk_need.stored_bytes(found.config))
        print(f"disk per node (the model's download, and a checkpoint's share or the final model in a bucket's cache): "
              f"{sizes}; SkyPilot gives {disk_need.DEFAULT_DISK_GB} GB unless resources.disk_size says "
              "(`orch run --disk-size`)")
    if no_kernels:
        table = cuda_arch.table()
        others = sorted({c for g in no_kernels for c in cuda_arch.builds_running(accelerators.CUDA_CAPABILITY[g],
                                                                                 cuda_arch.host_of(g))})
        unless = f", unless --image-id names an image holding its CUDA {' or '.join(others)} build" if others else ""
        print(f"{', '.join(sorted(no_kernels))}: torch {table['torch']}'s CUDA {table['lock_cuda']} build, which the "
              f"nodes install (uv.lock), has no kernels for them: a launch there is refused{unless}")  # fmt: skip
    if no_vllm:
        tokens = base.vllm_max_len or arch.positions
        print(f"{', '.join(sorted(no_vllm))}: colocated vLLM's share does not hold the weights and the KV cache of one "
              f"{tokens}-token sequence (its max_model_len), which vLLM refuses to start without; --vllm-max-len N "
              "(TRL's vllm_max_model_length) or a larger --vllm-colocate plans them")  # fmt: skip
    if no_bf16:
        print(f"{', '.join(sorted(no_bf16))}: no bf16 tensor cores (a launch there in bf16 is refused); "
              "--dtype float32 plans them for fp16 mixed precision over fp32 weights")  # fmt: skip
    if not prices:
        print("$/h: SkyPilot's catalog is not on this machine (`sky show-gpus` fetches it)")
    return 0


def _peak(estimate, capacity_gib: float) -> float:
    """GiB one GPU needs at the run's peak: the step with a colocated vLLM engine's share (core/vllm_fit.with_vllm),
    an evaluation beside it (core/eval_memory.py) or a generation without vLLM (core/generation_memory.estimate),
    whichever is more."""
    from orchestrator.core import eval_memory, generation_memory, vllm_fit

    during, making = eval_memory.estimate(estimate.setup), generation_memory.estimate(estimate.setup)
    return max(vllm_fit.with_vllm(estimate, capacity_gib), vllm_fit.with_vllm(during, capacity_gib) if during else 0.0,
               making.gib if making else 0.0)  # fmt: skip
