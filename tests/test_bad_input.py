"""Bad input through the real CLI: each of these exits 2 with one `orch: error:` line, no
traceback, and writes nothing. The table is orch's own, by class: flags, env knobs, TRL values and lists, secrets,
recipe and config files (binary, empty, wrong shape), paths (outside the repository, under a file, unwritable, too
long), `orch cp` onto what others use, run records."""

import os
import re
import sys

import pytest
from conftest import ROOT, orch

from orchestrator import cli

pytestmark = pytest.mark.cli

LONG = "r" * 300
BAD = [
    # flags and their values
    (["run", "phi3_dpo_fsdp", "--gpus", ""], "--gpus"),
    (["run", "phi3_dpo_fsdp", "--gpus", "A100:8:2"], "unknown accelerator 'A100:8'"),
    (["run", "phi3_dpo_fsdp", "--gpus", "A100:8", "--smoke"], "--smoke trains the recipe's tiny model"),
    (["run", "phi3_dpo_fsdp", "--nodes", "-3"], "at least 1 node"),
    (["run", "phi3_dpo_fsdp", "--nodes", "20000"], "at most 16384 nodes"),
    (["run", "phi3_dpo_fsdp", "--nodes", "1.5"], "invalid int value"),
    (["run", "phi3_dpo_fsdp", "--nodes"], "expected one argument"),
    # a flag that sets a knob is named as typed; the knob set with --env, as that
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "--max-cost", "lots"], "--max-cost 'lots': --max-cost takes"),
    (["run", "phi3_dpo_fsdp", "--local", "--max-cost", "-5"], "--max-cost '-5'"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_MAX_COST=-5"], "ORCH_MAX_COST='-5': ORCH_MAX_COST takes"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_PRICE_PER_HOUR=free"], "ORCH_PRICE_PER_HOUR takes a price"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_STALL_FLOOR=0"], "ORCH_STALL_FLOOR takes a number of seconds"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_PREFETCH_PROGRESS_S=soon"], "ORCH_PREFETCH_PROGRESS_S takes a number of"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_NETCHECK=maybe"], "ORCH_NETCHECK takes warn, error or off"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_TRACK=my project"], "ORCH_TRACK takes off or a Trackio"),
    (["dashboard", "no-such-run"], "no-such-run"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "ORCH_WATCHDOG=1"], "ORCH_WATCHDOG takes on or off"),
    (["run", "phi3_dpo_fsdp", "--idle-minutes", "soon"], "invalid int value"),
    (["run", "phi3_dpo_fsdp", "--cluster", "1abc"], "--cluster '1abc'"),
    (["run", "phi3_dpo_fsdp", "--gpu", "A100:8"], "did you mean --gpus?"),
    (["run", "phi3_dpo_fsdp", "--loc"], "did you mean --local?"),
    (["run", "phi3_dpo_fsdp", "--local", "--gpus", "CPU:0"], "positive"),
    (["run", "phi3_dpo_fsdp", "--local", "--detach"], "not --local"),
    (["status", "one", "extra"], "unrecognized arguments: extra"),
    (["status", "no-such-run"], "no run 'no-such-run' in sky_jobs/"),
    (["--frob"], "unrecognized arguments: --frob"),
    # secrets: no spelling of --secret or --env carries a value to disk
    (["run", "phi3_dpo_fsdp", "--se", "HF_TOKEN=hf_v4lue"], "did you mean --secret?"),
    (["run", "phi3_dpo_fsdp", "--secr=HF_TOKEN=hf_v4lue"], "--secr=..."),
    (["run", "phi3_dpo_fsdp", "--env", "WANDB_API_KEY=k"], "pass it as --secret WANDB_API_KEY"),
    (["run", "phi3_dpo_fsdp", "--env", "AWS_SECRET_ACCESS_KEY=k"], "looks like a credential"),
    (["run", "phi3_dpo_fsdp", "--env", "DB_PASSWORD=k"], "looks like a credential"),
    (["run", "phi3_dpo_fsdp", "hub_token=hf_v4lue"], "pass --secret HF_TOKEN"),
    # credentials by name or by shape, under any name, and values holding a declared secret's value
    (["run", "phi3_dpo_fsdp", "--env", "OPENAI_KEY=sk-proj-abcdefghijklmnop1234"], "pass it as --secret OPENAI_KEY"),
    (["run", "phi3_dpo_fsdp", "--env", "GH_PAT=ghp_abcdefghijklmnop1234"], "pass it as --secret GH_PAT"),
    (["run", "phi3_dpo_fsdp", "--env", "HF_AUTH=hf_abcdefghijklmnopqrstu"], "pass it as --secret HF_AUTH"),
    (["run", "phi3_dpo_fsdp", "--env", "NOTE=hf_abcdefghijklmnopqrstu"], "its value looks like a credential"),
    (["run", "phi3_dpo_fsdp", "--env", "WHO=AKIAABCDEFGHIJKLMNOP"], "its value looks like a credential"),
    (["run", "phi3_dpo_fsdp", "run_name=ghp_abcdefghijklmnop1234"], "--secret HF_TOKEN, read from your environment"),
    (["run", "phi3_dpo_fsdp", "--local", "--secret", "MY_HUB=s3cr3t-value-xyz", "run_name=a-s3cr3t-value-xyz"],
     "override run_name= holds the value of secret MY_HUB"),
    (["run", "phi3_dpo_fsdp", "--secret", "MY_HUB=s3cr3t-value-xyz", "--env", "NOTE=s3cr3t-value-xyz"],
     "--env NOTE holds the value of secret MY_HUB"),
    (["run", "phi3_dpo_fsdp", "--secret", "HF-TOKEN"], "not an environment variable name"),
    # the model out: --push-to-hub, orch pull
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "--push-to-hub", "me/model"], "pass --secret HF_TOKEN"),
    (["run", "phi3_dpo_fsdp", "--push-to-hub", "no slash", "--secret", "HF_TOKEN=hf_v4lue"],
     "--push-to-hub 'no slash': --push-to-hub takes a Hub repo id"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_PUSH_TO_HUB=no slash", "--secret", "HF_TOKEN=hf_v4lue"],
     "ORCH_PUSH_TO_HUB='no slash'"),
    (["run", "phi3_dpo_fsdp", "--push-to-hub", "me/a..b", "--secret", "HF_TOKEN=hf_v4lue"], "a Hub repo id"),
    (["pull", "no-such-run"], "no run 'no-such-run' in sky_jobs/"),
    (["pull", "never-submitted"], "run never-submitted has no cluster to fetch from"),  # and models/ is not left
    (["pull", "never-submitted", "recipes"], "recipes is not an empty directory"),
    (["plan", "nobody/knows-this-model"], "orch has no shape for"),
    (["plan", "meta-llama/Llama-3.1-8B", "--peft", "dora"], "invalid choice: 'dora'"),
    (["plan", "meta-llama/Llama-3.1-8B", "--strategy", "fsdp", "--gpus", "A100:8"], "TYPE:N per node; here, the total"),
    # orch's env knobs, parsed as the nodes parse them
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_RENDEZVOUS_TIMEOUT=-5"], "takes a number of seconds > 0"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_RENDEZVOUS_TIMEOUT=nan"], "takes a number of seconds > 0"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_VLLM_CLOSED_POLLS=0"], "a whole number >= 1"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_BARRIER_PORT=70000"], "is not a TCP port"),
    (["run", "phi3_dpo_fsdp", "--env", "MAIN_PROCESS_PORT=http"], "is not a TCP port"),
    (["run", "phi3_dpo_fsdp", "--env", "DDP_TIMEOUT=1.5"], "DDP_TIMEOUT"),
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_DEVICE=tpu"], "ORCH_DEVICE"),
    (["run", "phi3_dpo_fsdp", "--env", "GLOBAL_BATCH_SIZE=abc"], "GLOBAL_BATCH_SIZE"),
    (["run", "phi3_dpo_fsdp", "--env", "GLOBAL_BATCH_SIZE=0"], "GLOBAL_BATCH_SIZE"),
    (["run", "phi3_dpo_fsdp", "--env", "ACCELERATE_CONFIG=nope.yaml"], "cannot be read (No such file"),
    (["run", "phi3_dpo_fsdp", "--env", "TRL_CONFIG=/nonexistent/trl.yaml"], "cannot be read (No such file"),
    # TRL values, types, choices and list items, as TRL (or its trainer at the first step) would refuse them
    (["run", "phi3_dpo_fsdp", "beta=strong"], "beta takes a number"),
    (["run", "phi3_dpo_fsdp", "learning_rate=fast"], "learning_rate takes a number"),
    (["run", "phi3_dpo_fsdp", "bf16=maybe"], "bf16 takes true or false"),
    (["run", "phi3_dpo_fsdp", "max_steps="], "max_steps takes an integer"),
    # a strategy or device from TRL's arguments beside the Accelerate config's: a DDP recipe ran FSDP unknown to orch's
    # estimate and summary; use_cpu on GPU nodes trained on their CPUs (the rehearsal said MULTI_CPU)
    (["run", "qwen25_sft_ddp", "--dry-run", "fsdp=full_shard"], "fsdp=full_shard: TRL's fsdp argument sets a strategy "
     "beside the Accelerate config's (multi_gpu)"),
    (["run", "phi3_dpo_fsdp", "deepspeed=ds.json"], "drop deepspeed= and choose the strategy there"),
    (["run", "qwen25_sft_ddp", "use_cpu=true"], "use_cpu=true: the training processes would run on the nodes' CPUs"),
    # a misspelt orch knob: the cost cap it meant was never applied
    (["run", "phi3_dpo_fsdp", "--env", "ORCH_MAX_COSTS=5"], "--env ORCH_MAX_COSTS: orch reads no variable "
     "ORCH_MAX_COSTS; did you mean ORCH_MAX_COST?"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "--env", "ORCH_REHEARSALS=off"], "did you mean ORCH_REHEARSAL?"),
    # SkyPilot's candidate accelerators: orch plans one type (processes per node, batch, memory); --gpus picks it
    # a TRL config's env:, which TrlParser sets inside every rank: a credential travels with the workdir, orch never
    # reads a knob there, and a per-process variable overrides accelerate's (CUDA_VISIBLE_DEVICES '0': all on GPU 0)
    (["run", "env_token"], "TRL config recipes/trl/env_token.yaml: env.HF_TOKEN: HF_TOKEN looks like a credential"),
    (["run", "env_knob"], "env.ORCH_WATCHDOG: TRL sets its env inside the training processes, where orch never"),
    (["run", "env_cuda"], "env.CUDA_VISIBLE_DEVICES: TRL would set it inside every rank, and it would leave each "
     "node's processes fewer GPUs than orch starts"),
    (["run", "env_rank"], "env.LOCAL_RANK: TRL would set it inside every rank, and `accelerate launch` sets "
     "LOCAL_RANK for each training process from orch's layout; delete it"),
    # the same in a task env: SkyPilot's per-node variables and CUDA_VISIBLE_DEVICES (a task's RANK is set again by
    # accelerate for each process, and SKYPILOT_DOCKER_* are SkyPilot's own task settings: both taken)
    (["run", "phi3_dpo_fsdp", "--env", "CUDA_VISIBLE_DEVICES=0"], "--env CUDA_VISIBLE_DEVICES: it would leave each "
     "node's processes fewer GPUs than orch starts (one per GPU of the node, which --gpus chooses), and a rank asking "
     "for its own GPU would find none; drop it"),
    (["run", "phi3_dpo_fsdp", "--local", "--env", "SKYPILOT_NODE_RANK=0"], "--env SKYPILOT_NODE_RANK: SkyPilot sets "
     "SKYPILOT_NODE_RANK on every node itself, and orch lays out the ranks by it; drop it"),
    (["run", "candidates", "--dry-run"], "resources.accelerators ['A100:8', 'H100:8']: orch plans one accelerator "
     "type (processes per node, the global batch, the memory check): name one, for example A100:8, and pass another "
     "with --gpus"),
    (["run", "candidates", "--gpus", "8"], "resources.accelerators ['A100:8', 'H100:8']: orch plans one"),
    (["run", "knob_typo", "--local", "--smoke"], "recipes/knob_typo.yaml: envs.ORCH_WATCHDOGG: orch reads no variable "
     "ORCH_WATCHDOGG; did you mean ORCH_WATCHDOG?"),
    # a choice TRL's parser enforces from an Enum (optim, lr_scheduler_type, save_strategy): the ranks stopped on
    # argparse's `invalid choice` after the launch; YAML's unquoted no is false, which no choice is
    (["run", "phi3_dpo_fsdp", "optim=adamw"], "optim=adamw: did you mean adamw_torch? optim takes one of adamw_torch,"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "save_strategy=step"], "did you mean steps? save_strategy takes"),
    (["run", "eval_no"], "eval_strategy: False (YAML reads an unquoted no or yes as false or true: write \"no\"): "
     "eval_strategy takes one of no, steps, epoch"),
    # a dict argument TRL's config reads as JSON when it starts with {: the ranks stopped on JSONDecodeError
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "lr_scheduler_kwargs={min_lr:1e-6}"],
     "lr_scheduler_kwargs takes a JSON object, keys and strings in double quotes"),
    (["run", "phi3_dpo_fsdp", "model_init_kwargs=[1]"], "model_init_kwargs takes a JSON object"),
    (["run", "phi3_dpo_fsdp", "deepspeed={zero: 3}"], "deepspeed takes a JSON object, keys and strings in double "
     "quotes ('{\"key\": 1}': quote it whole for the shell) or a JSON file's path"),
    (["run", "phi3_dpo_fsdp", "loss_type=sigmoid,ipo"], "loss_type=sigmoid,ipo: separate the items with spaces and "
     "quote the whole for the shell: loss_type='sigmoid ipo'; loss_type takes a list of sigmoid"),
    (["run", "phi3_dpo_fsdp", "loss_type=[sigmoid, ipox]"], "loss_type=[sigmoid, ipox]: loss_type takes a list of"),
    # values a trainer compares only as it trains (if/elif/else raise in TRL's trainer: core/train/snapshots.py), or
    # only where vLLM runs: the ranks stopped after the model loaded, GRPO's after its first generation
    (["run", "qwen25_grpo_ddp", "importance_sampling_level=seq"], "importance_sampling_level takes one of token, "
     "sequence"),
    (["run", "qwen25_grpo_ddp", "multi_objective_aggregation=sum"], "takes one of sum_then_normalize, normalize_then"),
    (["run", "qwen25_grpo_ddp", "vllm_mode=servr"], "did you mean server? vllm_mode takes one of server, colocate"),
    (["run", "qwen25_rloo_ddp", "vllm_model_impl=hf"], "vllm_model_impl takes one of transformers, vllm"),
    (["run", "phi3_dpo_fsdp", "f_divergence_type=kl"], "f_divergence_type takes one of reverse_kl, forward_kl"),
    # a union of str and bool, which TRL's parser reads as a bool (its help's `all` is refused on the nodes)
    (["run", "qwen25_sft_ddp", "include_num_input_tokens_seen=all"], "include_num_input_tokens_seen takes true or "
     "false"),
    # a union of str and list, of which TRL's parser reads one word: the second was "Some specified arguments are not
    # used by the HfArgumentParser: ['tensorboard']"
    (["run", "qwen25_sft_ddp", "report_to=none tensorboard"], "report_to takes one value on the command line, where "
     "TRL's parser reads one word (several go as a YAML list in the TRL config file)"),
    (["run", "qwen25_rloo_ddp", "reward_clip_range=(-1,1)"], "reward_clip_range takes a YAML list in the TRL config "
     "file (for example [-1.0, 1.0]): TRL's parser makes a tuple of a command line's characters"),
    (["run", "qwen25_sft_ddp", "torch_compile_mode=fast"], "torch_compile_mode takes one of default, "),  # torch's
    # TRL's help says scale_rewards takes False, which only a YAML config gives: the command line's false is the text
    (["run", "qwen25_grpo_ddp", "scale_rewards=false"], "scale_rewards=false: on the command line TRL keeps false as "
     "text, which its trainer refuses at the first step (only a YAML config's scale_rewards: false means none): write "
     "scale_rewards=none; scale_rewards takes one of group, none, batch"),
    (["run", "qwen25_grpo_ddp", "loss_type=ppo"], "loss_type takes one of grpo"),
    (["run", "qwen25_kto_ddp", "loss_type=sigmoid"], "loss_type takes one of kto"),
    (["run", "qwen25_sft_ddp", "loss_type=dpo"], "loss_type takes one of nll"),
    (["run", "phi3_dpo_fsdp", "=5"], "is not key=value"),
    (["run", "phi3_dpo_fsdp", "model_name_or_path="], "model_name_or_path is empty"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "dataset_name="], "dataset_name is empty and no `datasets`"),
    # what the nodes' extras (the recipe's setup: node-setup.sh train) and CHECKPOINT_ROOT would drop or lack
    (["run", "phi3_dpo_fsdp", "use_liger_kernel=true"], "the nodes get Liger's kernels with orch's gpu extra"),
    (["run", "phi3_dpo_fsdp", "report_to=trackio"], "add --track, which installs it"),
    (["run", "phi3_dpo_fsdp", "output_dir=/data/mine"], "to CHECKPOINT_ROOT/<run>, /checkpoints/<run>, in place of"),
    # an output_dir that is no directory of the run's own: the final model (README.md, config.json) would overwrite
    # what is there, on any machine (a cloud launch without CHECKPOINT_ROOT, a local run), or this machine's files
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir="], "output_dir= is empty"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=./"], "output_dir=./: the directory the run starts"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=outputs/.."], "output_dir=outputs/..: the directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=../.."], "output_dir=../..: above the directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=~/"], "output_dir=~/: a home directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=//"], "output_dir=//: the file system root"),
    (["run", "phi3_dpo_fsdp", "--env", "CHECKPOINT_ROOT=", "output_dir=."], "output_dir=.: the directory the run"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=recipes"],
     "output_dir=recipes: recipes holds files no orch run made (accel_broken.yaml, "),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=sky_jobs/corrupt.yaml"], "is a file, not a directory"),
    # a local run's model or data given as a path that is not here: the ranks would ask the Hub for it, after launch
    (["run", "phi3_dpo_fsdp", "--local", "model_name_or_path=/nonexistent/m"],
     "model_name_or_path=/nonexistent/m: no such file or directory here (/nonexistent/m), where a local run's ranks"),
    (["run", "phi3_dpo_fsdp", "--local", "model_name_or_path=~/nonexistent-model"], "no such file or directory here"),
    (["run", "phi3_dpo_fsdp", "--local", "dataset_name=./missing"], "dataset_name=./missing: no such file"),
    (["run", "phi3_dpo_fsdp", "--local", "model_name_or_path=./recipes/trl/phi3_dpo.yaml"],
     "model_name_or_path=./recipes/trl/phi3_dpo.yaml is a file: transformers loads a model from a directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "dataset_name=./missing"], "dataset_name=./missing: no such file"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "dataset_name=./recipes/phi3_dpo_fsdp.yaml"],
     "dataset_name=./recipes/phi3_dpo_fsdp.yaml is a file: TRL loads dataset_name as a Hub id or a directory of data "
     "files; give the file with --data ./recipes/phi3_dpo_fsdp.yaml"),
    # GRPO's vLLM: a server the trainers would wait 240 s for on paid GPUs, or one that would serve nobody
    (["run", "qwen25_grpo_ddp", "vllm_mode=server"], "vllm_mode=server and no vLLM server to reach"),
    (["run", "qwen25_grpo_vllm_server", "vllm_mode=colocate"], "runs a vLLM server the trainers would not use"),
    (["run", "qwen25_grpo_vllm_server", "use_vllm=false"], "would not use (use_vllm is off)"),
    # recipe and config files
    (["run", LONG], "File name too long"),
    (["run", f"recipes/{LONG}.yaml"], "File name too long"),
    (["run", "binary"], "is not UTF-8 text"),
    (["run", "empty"], "must be a YAML mapping"),
    (["run", "listed"], "must be a YAML mapping"),
    (["run", "no_run"], "has no `run:` command"),
    (["run", "beta_high"], "beta: 'high': beta takes a number"),
    (["run", "trl_binary"], "is not UTF-8 text"),
    (["run", "trl_listed"], "must be a YAML mapping"),
    (["run", "accel_broken"], "not valid YAML"),
    # output paths of a local run
    (
        ["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=recipes/phi3_dpo_fsdp.yaml/out"],
        "is a file, not a directory",
    ),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "output_dir=/proc/orch-out"], "cannot write"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", f"output_dir=outputs/{LONG}"], "too long"),
    # orch cp: only inside recipes/, never onto a config another recipe uses
    (["cp", "phi3_dpo_fsdp", "../outside.yaml"], "inside recipes/"),
    (["cp", "phi3_dpo_fsdp", "/tmp/orch-elsewhere.yaml"], "inside recipes/"),
    (["cp", "phi3_dpo_fsdp", "qwen25_grpo", "--force"], "recipes/trl/qwen25_grpo.yaml is the TRL config of"),
    (["cp", "phi3_dpo_fsdp", "recipes/phi3_dpo_fsdp.yaml/x.yaml"], "Not a directory"),
    (["cp", "phi3_dpo_fsdp", LONG], "too long"),
    (["cp", "phi3_dpo_fsdp", "phi3_dpo_fsdp", "--force"], "is the recipe itself"),
    (["cp", "nope", "mine"], "unknown recipe 'nope'"),
    (["cp", "qwen25_sft_ddp", "Phi3_DPO_FSDP"], "differs from recipes/phi3_dpo_fsdp.yaml only in case"),
    (["cp", "qwen25_sft_ddp", "recipes/linked/mine.yaml"], "recipes/linked/trl/mine.yaml leads to"),
    # Accelerate config blocks and values of the wrong type: one line naming the key (core/accelerate_config.py)
    (["run", "accel_listed", "--dry-run"], "fsdp_config must be a mapping of settings, not a list"),
    (["run", "accel_stage", "--local", "--smoke"], "deepspeed_config.zero_stage='x' is not a whole number"),
    (["run", "accel_stage4"], "deepspeed_config.zero_stage=4 is not a ZeRO stage: DeepSpeed's are 0, 1, 2 and 3"),
    (["run", "accel_gpu_offload"], "deepspeed_config.offload_optimizer_device='gpu' is not an offload device: "
     "DeepSpeed's are none, cpu, nvme"),
    # a value accelerate's parser or FSDP plugin would refuse in the trainer's constructor (KeyError: 'SHARDED'), or
    # take for another (fsdp_version 3 ran FSDP1's code: KeyError: 'TRUE')
    (["run", "accel_dict_type", "--local", "--smoke"], "fsdp_config.fsdp_state_dict_type: 'SHARDED' is not one "
     "accelerate takes; did you mean SHARDED_STATE_DICT? use one of FULL_STATE_DICT, LOCAL_STATE_DICT, "
     "SHARDED_STATE_DICT"),
    (["run", "accel_v3", "--dry-run"], "fsdp_config.fsdp_version: 3 is not one accelerate takes; use one of 1, 2"),
    (["run", "accel_cp_size"], "does not pass parallelism_config.cp_size to the training processes (it is not an "
     "`accelerate launch` setting) and would drop it silently; did you mean "
     "parallelism_config.parallelism_config_cp_size?"),
    (["run", "accel_lower_type"], "distributed_type: 'fsdp' is not one accelerate takes; did you mean FSDP?"),
    # booleans accelerate's str_to_bool refuses in every rank (orch read them as false)
    (["run", "accel_offload_maybe"], "fsdp_config.fsdp_offload_params='maybe' is not a boolean accelerate takes: use "
     "true or false"),
    (["run", "accel_ckpt_null", "--local", "--smoke"], "fsdp_config.fsdp_activation_checkpointing=None is not a "
     "boolean accelerate takes"),
    # records and runs
    (["logs", LONG], "no run"),
    (["cancel", "nope"], "no run 'nope'"),
    (["down", "nope"], "no run 'nope'"),
    (["logs", "corrupt"], "is not a readable run record"),
    (["cancel", "never-submitted"], "was never submitted"),
    (["show", "phi3_dpo_fsdp", "max_steps=ten"], "max_steps takes an integer"),
    # values checked before launch: finite numbers, ranges the owners accept but cannot train, every port a node opens
    (["run", "phi3_dpo_fsdp", "--dry-run", "learning_rate=nan"], "learning_rate must be a finite number"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "beta=inf"], "beta must be a finite number"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "max_length=0"], "max_length must be at least 1"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "logging_steps=-5"], "logging_steps must be more than 0"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "max_steps=0"], "max_steps takes -1 (train by epochs) or at least 1"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "learning_rate=-1e-5"], "learning_rate must be at least 0"),
    # the sampler's bounds, checked by transformers' logits processors and vLLM only at the first generation
    (["run", "qwen25_grpo_ddp", "--dry-run", "top_k=-1"], "top_k must be at least 0"),
    (["run", "qwen25_grpo_ddp", "--dry-run", "min_p=1.5"], "min_p must be at most 1"),
    (["run", "qwen25_rloo_ddp", "--dry-run", "repetition_penalty=0"], "repetition_penalty must be more than 0"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--nodes", "2", "--env", "MAIN_PROCESS_PORT=65535"], "(65536)"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", "ORCH_BARRIER_PORT=29500"], "is MAIN_PROCESS_PORT's port too"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", "MAIN_PROCESS_PORT=22"], "MAIN_PROCESS_PORT is 22, where every "
     "SkyPilot node runs sshd"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", "MAIN_PROCESS_PORT=6379"], "ORCH_BARRIER_PORT (unset: "
     "MAIN_PROCESS_PORT + 1) is 6380, where every SkyPilot node runs SkyPilot's Ray head"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", "CHECKPOINT_ROOT=/checkpoints/../../etc"], "with '..'"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "--down"], "--down: for SkyPilot launches, not --local"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "--idle-minutes", "5"], "--idle-minutes: for SkyPilot"),
    # the quoting boundary (core/slots.py): values SkyPilot substitutes or a shell reads, checked by their slot
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", 'CHECKPOINT_BUCKET=x", "source": "/etc'],
     "CHECKPOINT_BUCKET (substituted into the task's file_mounts./checkpoints.name) 'x\", \"source\": \"/etc': "
     "use 3-63"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--env", "CHECKPOINT_BUCKET=My_Bucket!!"], "use 3-63 lowercase letters"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--image-id", "docker:ubuntu;touch /tmp/pwn"], "--image-id 'docker:ubuntu;"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--infra", "aws;id"], "--infra 'aws;id': use letters"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--cluster", ""], "--cluster '': use letters"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "--cluster", "ends-"], "ending with a letter or digit"),
    # one loader for every input file (core/files.py): regular files, UTF-8, capped, no aliases or duplicate keys,
    # SkyPilot's own task schema for the recipe's types (issue 30, item 3)
    (["run", "bomb"], "uses a YAML alias"),
    (["run", "merged"], "uses a YAML merge key"),
    (["run", "twice"], "sets 'num_nodes' twice"),
    (["run", "huge"], "is larger than 1024 KiB"),
    (["run", "nodes_abc"], "num_nodes: 'abc' is not of type 'integer'"),
    (["run", "nodes_half"], "num_nodes: 1.5 is not of type 'integer'"),
    (["run", "nodes_zero"], "num_nodes: 0: a run needs at least 1 node"),
    (["run", "resources_list"], "resources: ['A100'] is not of type 'object'"),
    (["run", "secrets_list"], "recipe needs secret HF_TOKEN: pass --secret HF_TOKEN"),  # SkyPilot's list spelling
    (["run", "mounts_list"], "file_mounts: ['a'] is not of type 'object'"),
    (["run", "run_list"], "run: ['orch', 'node'] is not of type 'string'"),
    (["run", "typo_field"], "'num_node' is not a SkyPilot task field; did you mean num_nodes?"),
    (["run", "resources_typo"], "'acelerators' is not a SkyPilot resources field; did you mean accelerators?"),
    (["run", "resources_both"], "resources: set accelerators or its alias gpus, not both"),
    (["run", "resources_spot"], "resources.use_spot: 'maybe' is not of type 'boolean' (SkyPilot's task schema)"),
    (["run", "mount_mode"], "file_mounts./checkpoints.mode: 'MOUNTCACHED' is not one of ['MOUNT', 'COPY', "),
    # SkyPilot builds each any_of/ordered candidate as the top level updated with its fields: they would win, silently
    (["run", "any_of_gpus", "--gpus", "L4:8", "--dry-run"], "resources.any_of[0] names accelerators (L4:8), which "
     "SkyPilot puts over the top level's and --gpus: orch plans one accelerator type"),
    (["run", "ordered_gpus", "--dry-run"], "resources.ordered[0] names accelerators (H100:8)"),
    (["run", "any_of_infra", "--infra", "aws", "--dry-run"], "resources.any_of[0] sets infra, which SkyPilot puts "
     "over --infra (a candidate's fields win over the top level's)"),
    (["run", "git_workdir"], "workdir is a git repository (https://example.com/me/orch.git): orch reads the "
     "recipe's configs and checks the launch from a local workdir"),
    (["run", "int_key"], "'1' is not a SkyPilot task field"),  # YAML reads 1 as an int key: no traceback
    (["run", "null_key"], "'None' is not a SkyPilot task field"),
    (["run", "phi3_dpo_fsdp", "--env", "TRL_CONFIG=/dev/zero"], "is a device, FIFO or socket, not a regular file"),
    (["run", "phi3_dpo_fsdp", "--env", "ACCELERATE_CONFIG=/dev/urandom"], "not a regular file"),
    (["run", "phi3_dpo_fsdp", "--env", "TRL_CONFIG=recipes"], "is a directory, not a regular file"),
    (["run", "recipes/fifo.yaml"], "not a regular file"),
    (["logs", "zero"], "not a regular file"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "--data", "latin1.jsonl"], "line 2 is not UTF-8 text"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "--data", "corrupt.parquet"], "not a readable Parquet file"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "--data", "hello.jsonl"],
     "has column messages as a string (\"hello\")"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "--data", "/dev/zero.jsonl"], "no such file"),
    (["run", "qwen25_sft_ddp", "--local", "--smoke", "--data", ""], "give a JSON Lines (.jsonl) or Parquet"),
    # transformers' own Hub push: the whole output_dir at every save; orch pushes the final model (--push-to-hub)
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "push_to_hub=true", "hub_model_id=me/dpo"],
     "push_to_hub=true: transformers would upload the whole output_dir (orch's reports included) at every save; orch "
     "pushes the final model, its token checked before training: drop push_to_hub and pass --push-to-hub me/dpo "
     "--secret HF_TOKEN"),
    (["run", "phi3_dpo_fsdp", "--dry-run", "push_to_hub=1"], "pass --push-to-hub OWNER/NAME --secret HF_TOKEN"),
    # resume_from_checkpoint that holds no checkpoint: the ranks stopped on FileNotFoundError after the model loaded
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "resume_from_checkpoint=outputs/nope/checkpoint-4"],
     "resume_from_checkpoint=outputs/nope/checkpoint-4: no such directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "resume_from_checkpoint=hello.jsonl"],
     "resume_from_checkpoint=hello.jsonl: not a directory"),
    (["run", "phi3_dpo_fsdp", "--local", "--smoke", "resume_from_checkpoint=recipes"],
     "resume_from_checkpoint=recipes: a directory without trainer_state.json"),
    # a path a cloud run's nodes read from the uploaded workdir, which it is not in (launch/node_paths.py)
    (["run", "phi3_dpo_fsdp", "--dry-run", "model_name_or_path=./merged"],
     "model_name_or_path=./merged: no such file or directory in the workdir"),
    # a --data file is one split, train: an evaluation would look for `test` on the nodes, after the model loaded
    (["run", "qwen25_sft_ddp", "--data", "chat.jsonl", "eval_strategy=steps"], "--data gives one split, train, and "
     "eval_strategy=steps evaluates on dataset_test_split=test: add dataset_test_split=train"),
    (["run", "qwen25_sft_ddp", "--local", "--data", "chat.jsonl", "eval_strategy=epoch", "dataset_test_split=dev"],
     "eval_strategy=epoch evaluates on dataset_test_split=dev"),
    (["run", "qwen25_sft_ddp", "--local", "--data", "chat.jsonl", "dataset_name=org/other"], "--data chat.jsonl and "
     "dataset_name=org/other: --data is the dataset TRL reads, as dataset_name=<its folder> and its one split, train: "
     "drop dataset_name=, or drop --data"),
    (["run", "qwen25_sft_ddp", "--data", "chat.jsonl", "dataset_train_split=validation"], "and "
     "dataset_train_split=validation: --data is the dataset TRL reads"),
    (["run", "qwen25_sft_ddp", "--data", "chat.jsonl", 'datasets=[{"path": "org/a"}]'], "set a `datasets` mixture, "
     "which TRL loads in its place: remove `datasets`, or drop --data"),
]


def _tree(root):
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def bad_project(tmp_path_factory):
    """A project of broken recipes, configs, data files and records, made once per worker (~0.05 s a test when each
    of the ~220 rows made its own): every test that takes it checks it wrote nothing there."""
    import shutil

    project = tmp_path_factory.mktemp("bad-project")
    shutil.copytree(ROOT / "recipes", project / "recipes")
    recipes = project / "recipes"
    phi3 = (recipes / "phi3_dpo_fsdp.yaml").read_text()
    dpo = (recipes / "trl" / "phi3_dpo.yaml").read_text()
    (recipes / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" + os.urandom(64))
    (recipes / "empty.yaml").write_text("")
    (recipes / "listed.yaml").write_text("- a\n- b\n")
    (recipes / "no_run.yaml").write_text(phi3.split("\nrun:")[0] + "\n")
    (recipes / "trl" / "beta_high.yaml").write_text(
        re.sub(r"^beta:.*$", "beta: high", (recipes / "trl" / "phi3_dpo.yaml").read_text(), count=1, flags=re.M))
    (recipes / "beta_high.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/beta_high.yaml"))
    for name, env in (("env_token", "HF_TOKEN: hf_abcdefghijklmnopqrstu"), ("env_knob", "ORCH_WATCHDOG: 'off'"),
                      ("env_cuda", "CUDA_VISIBLE_DEVICES: '0'"), ("env_rank", "LOCAL_RANK: 0")):
        (recipes / "trl" / f"{name}.yaml").write_text(dpo + f"env:\n  {env}\n")
        (recipes / f"{name}.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", f"recipes/trl/{name}.yaml"))
    (recipes / "candidates.yaml").write_text(phi3.replace("accelerators: A100:8", "accelerators: [A100:8, H100:8]"))
    (recipes / "knob_typo.yaml").write_text(phi3.replace("  MAIN_PROCESS_PORT: 29500\n",
                                                         "  MAIN_PROCESS_PORT: 29500\n  ORCH_WATCHDOGG: 'off'\n"))
    (recipes / "trl" / "eval_no.yaml").write_text(dpo + "eval_strategy: no\n")
    (recipes / "eval_no.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/eval_no.yaml"))
    (recipes / "trl" / "binary.yaml").write_bytes(b"\xff\xfe\x00binary" + os.urandom(32))
    (recipes / "trl_binary.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/binary.yaml"))
    (recipes / "trl" / "listed.yaml").write_text("- beta\n")
    (recipes / "trl_listed.yaml").write_text(phi3.replace("recipes/trl/phi3_dpo.yaml", "recipes/trl/listed.yaml"))
    (recipes / "accelerate" / "broken.yaml").write_text("distributed_type: [FSDP\n")
    accel = phi3.replace("recipes/accelerate/fsdp2_phi3.yaml", "recipes/accelerate/broken.yaml")
    (recipes / "accel_broken.yaml").write_text(accel)
    (recipes / "accelerate" / "listed.yaml").write_text("distributed_type: FSDP\nfsdp_config: [1]\n")
    accel = phi3.replace("recipes/accelerate/fsdp2_phi3.yaml", "recipes/accelerate/listed.yaml")
    (recipes / "accel_listed.yaml").write_text(accel)
    fsdp2 = (recipes / "accelerate" / "fsdp2_phi3.yaml").read_text()
    edits = {"dict_type": ("SHARDED_STATE_DICT", "SHARDED"), "v3": ("fsdp_version: 2", "fsdp_version: 3"),
             "offload_maybe": ("fsdp_offload_params: false", "fsdp_offload_params: maybe"),
             "ckpt_null": ("fsdp_activation_checkpointing: true", "fsdp_activation_checkpointing: null"),
             "cp_size": ("fsdp_config:", "parallelism_config: {cp_size: 2}\nfsdp_config:"),
             "lower_type": ("distributed_type: FSDP", "distributed_type: fsdp")}  # DistributedType(value): exact
    for name, edit in edits.items():
        (recipes / "accelerate" / f"{name}.yaml").write_text(fsdp2.replace(*edit))
        (recipes / f"accel_{name}.yaml").write_text(phi3.replace("recipes/accelerate/fsdp2_phi3.yaml",
                                                                 f"recipes/accelerate/{name}.yaml"))  # fmt: skip
    (recipes / "accelerate" / "stage.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: x}")
    accel = phi3.replace("recipes/accelerate/fsdp2_phi3.yaml", "recipes/accelerate/stage.yaml")
    (recipes / "accel_stage.yaml").write_text(accel)
    stage4 = "distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 4}\n"  # DeepSpeed's stages are 0-3
    (recipes / "accelerate" / "stage4.yaml").write_text(stage4)
    gpu = "distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3, offload_optimizer_device: gpu}\n"
    (recipes / "accelerate" / "gpu_offload.yaml").write_text(gpu)
    (recipes / "accel_gpu_offload.yaml").write_text(phi3.replace("recipes/accelerate/fsdp2_phi3.yaml",
                                                                 "recipes/accelerate/gpu_offload.yaml"))  # fmt: skip
    (recipes / "accel_stage4.yaml").write_text(phi3.replace("recipes/accelerate/fsdp2_phi3.yaml",
                                                            "recipes/accelerate/stage4.yaml"))  # fmt: skip
    (recipes / "bomb.yaml").write_text(phi3 + "x: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(12)))
    (recipes / "merged.yaml").write_text(phi3 + "base: &base {a: 1}\nother:\n  <<: *base\n")
    (recipes / "twice.yaml").write_text(phi3 + "num_nodes: 2\n")
    (recipes / "huge.yaml").write_text(phi3 + "# " + "x" * (1 << 20) + "\n")
    for name, field in (("nodes_abc", "num_nodes: abc"), ("nodes_half", "num_nodes: 1.5"),
                        ("nodes_zero", "num_nodes: 0"), ("resources_list", "resources: [A100]"),
                        ("secrets_list", "secrets: [HF_TOKEN]"), ("mounts_list", "file_mounts: [a]"),
                        ("typo_field", "num_node: 2"), ("int_key", "1: x"), ("null_key", "null: x"),
                        ("resources_typo", "resources: {acelerators: A100:8}"),
                        ("resources_both", "resources: {gpus: A100:8, accelerators: A100:8}"),
                        ("resources_spot", "resources: {accelerators: A100:8, use_spot: maybe}"),
                        ("mount_mode", "file_mounts: {/checkpoints: {name: b, mode: MOUNTCACHED}}"),
                        ("any_of_gpus", "resources: {any_of: [{accelerators: L4:8}, {accelerators: A10G:8}]}"),
                        ("any_of_infra", "resources: {accelerators: A100:8, any_of: [{infra: aws}, {infra: gcp}]}"),
                        ("ordered_gpus", "resources: {accelerators: A100:8, ordered: [{accelerators: H100:8}]}"),
                        ("git_workdir", "workdir: {url: https://example.com/me/orch.git, ref: main}"),
                        ):  # fmt: skip
        key = field.split(":")[0]
        text = re.sub(rf"^{key}:.*?(?=^\S)", "", phi3, flags=re.M | re.S) if key in phi3 else phi3
        (recipes / f"{name}.yaml").write_text(text + field + "\n")
    (recipes / "run_list.yaml").write_text(phi3.split("\nrun:")[0] + "\nrun: [orch, node]\n")
    os.mkfifo(recipes / "fifo.yaml")
    (project / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (project / "corrupt.parquet").write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
    (project / "hello.jsonl").write_text('{"messages": "hello"}\n')
    (project / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", '
                                        '"content": "Hello!"}]}\n')
    (recipes / "linked").mkdir()
    (recipes / "linked" / "trl").symlink_to(project / "outside")  # a linked folder leading out of recipes/
    (project / "outside").mkdir()
    jobs = project / "sky_jobs"
    jobs.mkdir()
    (jobs / "zero.yaml").symlink_to("/dev/zero")
    (jobs / "corrupt.yaml").write_bytes(b"# run: corrupt\n\xff\xfe: [\n")
    (jobs / "never-submitted.yaml").write_text(
        "# run: never-submitted\n# backend: sky-cluster\n# cluster: c1\n# state: failed to launch\n\nname: x\n"
    )
    return project


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a)[:50] for a, _ in BAD])
def test_bad_input(bad_project, monkeypatch, capsys, argv, message):
    assert len(BAD) >= 60
    monkeypatch.chdir(bad_project)
    monkeypatch.setenv("SKYPILOT_DISABLE_LOCAL_API_SERVER", "1")
    before = _tree(bad_project)
    code = cli.main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, out.out + out.err
    assert len(lines) == 1 and lines[0].startswith("orch: error: "), out.err
    assert message in lines[0], lines[0]
    assert out.out == "", out.out  # a refused launch says its one line, no note before it
    for value in ("hf_v4lue", "s3cr3t-value", "abcdefghijklmnop"):  # a secret's value is never echoed
        assert value not in out.out + out.err
    assert _tree(bad_project) == before  # nothing written


def test_the_table_runs_through_the_installed_cli(bad_project):
    """One row through `python -m orchestrator`, to show the in-process rows are the CLI's own exits."""
    import subprocess

    before = _tree(bad_project)
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", "binary"], cwd=bad_project, capture_output=True, text=True
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("orch: error: ") and "binary" in line, line
    assert _tree(bad_project) == before


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"messages": [{"role": "user", "content": "Hi"}]}, {"prompt": "x", "answer": "y"}],
         "row 2 has no column completion (it has answer, prompt); TRL's sft trainer reads messages or text or prompt + "
         "completion, e.g. {\"messages\""),
        (["not json"], "line 1 is not JSON"),
        ([], "the file holds no rows"),
    ],
)
def test_a_data_file_without_the_trainers_columns_is_refused_with_one_line(project, rows, message):
    import json

    path = project / "mine.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    for where in (["--local", "--smoke"], ["--gpus", "A100:8", "--dry-run", "--skip-optimizer"]):
        result = orch("run", "qwen25_sft_ddp", *where, "--data", "mine.jsonl", cwd=project)
        assert result.returncode == 2 and result.stdout == "", result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("orch: error: --data mine.jsonl: ") and message in line, line
    assert not (project / "sky_jobs").exists() and not (project / "outputs").exists()


def test_a_parquet_data_file_is_checked_too(project):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2+2?"], "completion": ["4"]}), project / "kto.parquet")
    result = orch("run", "qwen25_kto_ddp", "--local", "--smoke", "--data", "kto.parquet", cwd=project)
    assert result.returncode == 2
    assert "row 1 has no column label (it has completion, prompt); TRL's kto trainer reads prompt + completion + " \
        "label" in result.stderr  # fmt: skip


@pytest.mark.unit
def test_every_row_of_a_parquet_file_is_checked_for_what_its_schema_allows(tmp_path, monkeypatch):
    """A Parquet schema types every row as the first, but a null or an empty list may lie in any row (TRL stops on
    them after the launch): the columns TRL reads are scanned in batches, the row named. The count said is the
    file's, and a smoke run's sample holds its first 128 rows (it said 1 row, and linked the whole file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.core.errors import OrchError
    from orchestrator.launch import data

    turn = [{"role": "user", "content": "2+2?"}]
    rows = {"prompt": [turn] * 300, "chosen": [turn] * 300, "rejected": [turn] * 300, "note": [None] * 300}
    pq.write_table(pa.table(rows), tmp_path / "ok.parquet", row_group_size=100)
    assert data.check(tmp_path / "ok.parquet", "dpo") == 300  # an unread column may be null
    for value, said in ((None, "null"), ([], "an empty list")):
        bad = dict(rows, rejected=[turn] * 250 + [value] + [turn] * 49)
        pq.write_table(pa.table(bad), tmp_path / "bad.parquet", row_group_size=100)
        with pytest.raises(OrchError) as refused:
            data.check(tmp_path / "bad.parquet", "dpo")
        assert str(refused.value) == (f"--data {tmp_path / 'bad.parquet'}: row 251 has column rejected as {said}, "
                                      "which TRL's dpo trainer cannot read")  # fmt: skip
    sample = data.local_dir(tmp_path / "ok.parquet", True, tmp_path / "cache") / "train.parquet"
    assert pq.read_table(sample).num_rows == data.SMOKE_ROWS and not sample.is_symlink()


def test_dashboard_of_an_untracked_run_says_how_to_track_it(project):
    from orchestrator.launch import records

    os.chdir(project)
    try:
        (project / "outputs" / "r1").mkdir(parents=True)
        backend = "local (2 emulated node(s) x 1 CPU process(es))"
        records.write(records.new("r1", {"name": "x"}, "recipes/x.yaml", "orch run x", backend=backend,
                                  output_dir="outputs/r1"))  # fmt: skip
    finally:
        os.chdir(ROOT)
    result = orch("dashboard", "r1", "--no-open", cwd=project)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "orch: error: no Trackio curves in outputs/r1/trackio/: run r1 was not tracked (rerun it with --track) or "
        "saved no checkpoint yet"
    )


def test_ls_lists_every_broken_recipe_with_its_reason(bad_project, monkeypatch, capsys):
    """An alias bomb, a FIFO or a wrong type is one row saying why, never a hang or a recipe silently left out."""
    monkeypatch.chdir(bad_project)
    before = _tree(bad_project)
    assert cli.main(["ls"]) == 0
    assert _tree(bad_project) == before  # the project is the module's: nothing written
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "uses a YAML alias" in rows["bomb"] and "not a regular file" in rows["fifo"]
    assert "num_nodes: 'abc'" in rows["nodes_abc"] and "phi3_dpo_fsdp" in rows
    assert "A100:8|H100:8" in rows["candidates"] and "broken" not in rows["candidates"]  # `orch run --gpus` picks one
    assert rows["accel_lower_type"].split()[2] == "?" and rows["accel_cp_size"].split()[2] == "?"  # run refuses both


def test_a_recipe_with_candidate_accelerators_runs_on_the_one_gpus_names(bad_project, monkeypatch, capsys):
    monkeypatch.chdir(bad_project)
    monkeypatch.setenv("SKYPILOT_DISABLE_LOCAL_API_SERVER", "1")
    monkeypatch.setenv("ORCH_DATA_CHECK", "off")
    before = _tree(bad_project)
    assert cli.main(["run", "candidates", "--gpus", "H100:8", "--dry-run", "--skip-optimizer"]) == 0
    assert "\n  accelerators: H100:8\n" in capsys.readouterr().out
    assert _tree(bad_project) == before  # a dry run writes nothing (and the project is the module's)


@pytest.mark.parametrize("name, value", [("ORCH_STOP_GRACE", "abc"), ("ORCH_REHEARSAL", "maybe"),
                                         ("ORCH_LAUNCHED_AT", "abc")])  # fmt: skip
def test_a_bad_knob_in_the_callers_environment_stops_a_local_run_before_it_starts(project, monkeypatch, capsys,
                                                                                  name, value):  # fmt: skip
    """The local nodes inherit orch's environment: a knob there is refused by orch with one line, not by a node's
    guard with a traceback."""
    monkeypatch.chdir(project)
    monkeypatch.setenv(name, value)
    before = _tree(project)
    assert cli.main(["run", "qwen25_sft_ddp", "--local", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("orch: error:") == 1 and f"{name}={value!r}" in err and "Traceback" not in err
    assert _tree(project) == before


def test_dashboard_of_a_run_whose_trackio_copies_are_damaged_says_so(project, monkeypatch, capsys):
    from orchestrator.launch import records

    monkeypatch.chdir(project)
    monkeypatch.setenv("ORCH_CACHE_DIR", str(project / "cache"))
    (project / "outputs" / "r1" / "trackio" / "node0").mkdir(parents=True)
    (project / "outputs" / "r1" / "trackio" / "node0" / "p.db").write_bytes(b"SQLite format 3\x00garbage")
    records.write(records.new("r1", {"name": "x"}, "recipes/x.yaml", "orch run x", platform="local",
                              backend="local (1 node)", output_dir=str(project / "outputs" / "r1")))  # fmt: skip
    assert cli.main(["dashboard", "r1", "--no-open"]) == 2
    out = capsys.readouterr()
    assert "leaving out" in out.out and "file is not a database" in out.out
    assert out.err.count("orch: error:") == 1 and "no readable Trackio database" in out.err
    assert not (project / "cache" / "dashboards" / "r1" / "trackio").exists()


_C = [{"role": "assistant", "content": "4"}]
_M = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.mark.unit
@pytest.mark.parametrize(
    "trainer, rows, field, message",
    [  # each refused row stopped the ranks after the launch before (TRL 1.16, measured by a local smoke run each)
        ("dpo", [{"prompt": 1, "chosen": "b", "rejected": "c"}], "text", "row 1 has column prompt as a number (1)"),
        ("dpo", [{"prompt": None, "chosen": "b", "rejected": "c"}], "text", "row 1 has column prompt as null, "),
        ("dpo", [{"chosen": "b", "rejected": "c"}, {"chosen": _C, "rejected": _C}], "text",
         "row 2 holds conversations where row 1 holds strings: TRL takes a dataset's format from its first row"),
        ("dpo", [{"prompt": "2+2?", "chosen": _C, "rejected": _C}], "text",
         "row 1 has prompt as a string and chosen, rejected as conversations; TRL reads a row as all strings or all"),
        ("dpo", [{"chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b", "rejected": "c"}], "text",
         "row 2 has chosen, prompt, rejected where row 1 has chosen, rejected: datasets gives a row a null"),
        ("sft", [{"text": "hello"}, {"messages": _M}], "text", "row 2 has messages where row 1 has text"),
        ("sft", [{"messages": []}], "text", "row 1 has column messages as an empty list, "),
        ("sft", [{"messages": _M, "prompt": "x"}], "text", "row 1 has no column completion (it has messages, prompt)"),
        ("sft", [{"content": "hello"}], "text", "row 1 has none of the columns TRL's sft trainer reads (it has "
         "content); it reads messages or text or prompt + completion, e.g. {\"messages\": [{\"role\": \"user\", "
         "\"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}]}; dataset_text_field=COLUMN reads "
         "another column as text"),
        ("sft", [{"content": 3}], "content", "row 1 has column content as a number (3)"),
        ("kto", [{"prompt": "a", "completion": "b", "label": "yes"}], "text", "has column label as a string (\"yes\")"),
        ("grpo", [{"prompt": []}], "text", "row 1 has column prompt as an empty list"),
        # what TRL reads, accepted: a pair's prompt in every row or none, unread columns as they come, a text column
        ("dpo", [{"chosen": _C, "rejected": _C}, {"chosen": _C, "rejected": _C, "id": 2}], "text", None),
        ("dpo", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2, "text", None),
        ("sft", [{"content": "hello"}, {"content": "more", "source": None}], "content", None),
        ("sft", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d", "messages": None}], "text",
         None),
    ],
)
def test_a_data_row_trl_cannot_read_is_refused_by_what_is_wrong(tmp_path, trainer, rows, field, message):
    """The class of --data rows TRL 1.16 cannot read (core/dataset_format.py): a column in another type, strings and
    conversations in one row, and rows unlike the first (another column set, another kind), besides a missing column."""
    import json

    from orchestrator.core.errors import OrchError
    from orchestrator.launch import data

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if message is None:
        assert data.check(path, trainer, field) == len(rows)
        return
    with pytest.raises(OrchError) as refused:
        data.check(path, trainer, field)
    assert str(refused.value).startswith(f"--data {path}: ") and message in str(refused.value), refused.value


def test_a_data_files_text_column_is_read_as_dataset_text_field_says(project):
    """SFT reads a standard row's text from the column dataset_text_field names (TRL's SFTConfig): a --data file of
    such rows was refused for lacking `text`; it is taken with the setting, and the refusal without it names it."""
    (project / "notes.jsonl").write_text('{"body": "one note"}\n{"body": "another"}\n')
    where = ["--gpus", "A100:8", "--dry-run", "--skip-optimizer"]
    taken = orch("run", "qwen25_sft_ddp", *where, "--data", "notes.jsonl", "dataset_text_field=body", cwd=project)
    assert taken.returncode == 0, taken.stderr
    assert "[orch] data: notes.jsonl (2 rows) has the columns TRL's sft trainer reads" in taken.stdout
    refused = orch("run", "qwen25_sft_ddp", *where, "--data", "notes.jsonl", cwd=project)
    assert refused.returncode == 2 and "dataset_text_field=COLUMN reads another column as text" in refused.stderr


@pytest.mark.unit
def test_every_rank_refuses_a_resume_from_checkpoint_that_holds_none(tmp_path, capsys):
    """On a cloud node the path is the node's: each rank judges it (train/resumption.py) before transformers reads
    its trainer_state.json; rank 0 says why, every rank exits 2."""
    from types import SimpleNamespace

    from orchestrator.train import resumption

    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True))
    gone = tmp_path / "checkpoint-4"
    with pytest.raises(SystemExit) as ended:
        resumption.checkpoint(trainer, None, str(gone), tmp_path)
    assert ended.value.code == 2
    assert capsys.readouterr().out == (
        f"orch: error: resume_from_checkpoint={gone}: no such directory ({gone}), not a"
        " checkpoint transformers resumes from (a checkpoint-N directory with trainer_state.json); orch resumes "
        "from output_dir's newest complete checkpoint by itself: drop resume_from_checkpoint, or give a checkpoint's "
        "directory\n"
    )


@pytest.mark.unit
def test_a_dict_argument_takes_a_json_object_or_where_the_owner_reads_one_a_file():
    """TRL's and transformers' configs read a dict argument given as text with json.loads when it starts with { (their
    _VALID_DICT_FIELDS, snapshotted as kind "dict", or "dict|file" where the help names a JSON file): checked here,
    from a key=value word and from a TRL config file's value."""
    from orchestrator.core import trl_schema
    from orchestrator.core.errors import OrchError

    assert trl_schema.fields("sft")["lr_scheduler_kwargs"] == "dict"
    assert trl_schema.fields("dpo")["fsdp_config"] == "dict|file"
    trl_schema.check("sft", {"lr_scheduler_kwargs": '{"min_lr": 1e-6}', "fsdp_config": "fsdp.json",
                             "model_init_kwargs": "none", "deepspeed": '{"zero_optimization": {"stage": 3}}'})
    trl_schema.check_config_keys("sft", {"lr_scheduler_kwargs": {"min_lr": 1e-6}, "deepspeed": "ds.json"}, "c.yaml")
    for bad in ("{min_lr: 1e-6}", "[1]", "min_lr=1e-6", '{"a": 1'):
        with pytest.raises(OrchError, match="lr_scheduler_kwargs takes a JSON object"):
            trl_schema.check("sft", {"lr_scheduler_kwargs": bad})
    with pytest.raises(OrchError, match=r"^TRL config c.yaml: gradient_checkpointing_kwargs: \[1\]: "):
        trl_schema.check_config_keys("sft", {"gradient_checkpointing_kwargs": [1]}, "c.yaml")


@pytest.mark.unit
def test_an_env_name_one_slip_from_a_variable_orch_reads_gets_a_note():
    """`--env GLOBAL_BATCH=32` reached the task and nothing read it (GLOBAL_BATCH_SIZE kept the recipe's): a note
    names the variable meant; a name of the user's own code (NCCL_DEBUG, WANDB_PROJECT) gets none. READ_ENVS are
    names orch's code reads."""
    from conftest import ROOT

    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.resolved import READ_ENVS, env_notes

    phi3 = recipes.load(str(ROOT / "recipes" / "phi3_dpo_fsdp.yaml"))
    given = {"GLOBAL_BATCH": "32", "NCCL_DEBUG": "INFO", "CHECKPOINT_BUCKETS": "b", "WANDB_PROJECT": "p"}
    assert env_notes(given, phi3) == [
        "[orch] note: --env GLOBAL_BATCH is read by nothing orch or the recipe knows; did you mean GLOBAL_BATCH_SIZE?",
        "[orch] note: --env CHECKPOINT_BUCKETS is read by nothing orch or the recipe knows; did you mean "
        "CHECKPOINT_BUCKET?",
    ]
    source = "".join(p.read_text() for p in (ROOT / "orchestrator").rglob("*.py") if p.name != "resolved.py")
    assert [name for name in READ_ENVS if f'"{name}"' not in source] == []


@pytest.mark.unit
def test_what_the_owners_code_would_run_must_be_the_strategy_orch_planned():
    """checks._not_as_planned, after every rehearsal of a GPU launch: the distributed type and ZeRO stage the
    rehearsed trainer reports, against the Accelerate config's strategy (a DDP recipe that TRL's own fsdp argument
    turned into FSDP, GPU nodes that use_cpu turned into CPU processes, a DeepSpeed JSON at another stage)."""
    from conftest import ROOT

    from orchestrator.core.accelerators import Gpus
    from orchestrator.launch import recipe as recipes
    from orchestrator.launch.checks import _not_as_planned
    from orchestrator.launch.resolved import resolve

    def judged(name, **facts):
        launch = resolve(recipes.load(str(ROOT / "recipes" / f"{name}.yaml")), gpus=Gpus("H100", 8))
        return _not_as_planned(launch, facts)

    assert judged("qwen25_sft_ddp", distributed_type="MULTI_GPU") is None
    assert judged("phi3_dpo_fsdp", distributed_type="FSDP") is None
    assert judged("qwen25_dpo_zero2", distributed_type="DEEPSPEED", zero_stage=2) is None
    assert judged("qwen25_sft_ddp", distributed_type="FSDP").startswith(
        "the owners' code would run FSDP where the Accelerate config (multi_gpu) plans ddp")
    assert "would run MULTI_CPU" in judged("phi3_dpo_fsdp", distributed_type="MULTI_CPU")
    assert "would run MULTI_GPU" in judged("qwen25_dpo_zero2", distributed_type="MULTI_GPU")
    assert judged("qwen25_sft_ddp", distributed_type="MULTI_GPU", device="cuda") is None
    assert judged("qwen25_sft_ddp", distributed_type="MULTI_GPU", device="cpu").startswith(
        "the training processes would run on the cpu device, not the GPUs")
    stage_in_json = resolve(recipes.load(str(ROOT / "recipes" / "qwen25_dpo_zero2.yaml")), gpus=Gpus("H100", 8))
    stage_in_json = stage_in_json.replace(paired=stage_in_json.paired._replace(
        accelerate={"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    assert _not_as_planned(stage_in_json, {"distributed_type": "DEEPSPEED", "zero_stage": 3}) is None  # its JSON says
    assert judged("qwen25_dpo_zero2", distributed_type="DEEPSPEED", zero_stage=3).startswith(
        "DeepSpeed would run ZeRO-3 where the Accelerate config (zero2) plans zero2")


@pytest.mark.unit
def test_a_local_run_that_cannot_fit_this_machine_is_refused_before_a_process_starts(tmp_path):
    """`--local --nodes 64` (a cloud command with --local added) started 64 launchers and ranks (~51 GiB measured at
    0.8 GiB a smoke node): refused when even the measured floor exceeds MemAvailable, never a run that fits."""
    from orchestrator.core.errors import OrchError
    from orchestrator.launch.backends.local_backend import _fits_here

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    4194304 kB\n")
    _fits_here(2, 2, meminfo)  # 2 x (0.22 + 2 x 0.5) = 2.4 GiB of 4
    with pytest.raises(OrchError, match=r"^--local: 8 emulated node\(s\) x 1 process\(es\) hold 5\.8 GiB at least .* "
                                        r"this machine has 4\.0 GiB available: use fewer --nodes"):  # fmt: skip
        _fits_here(8, 1, meminfo)
    _fits_here(64, 8, tmp_path / "absent")  # nothing to judge by: not refused
