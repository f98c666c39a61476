"""`orch node`: on a node, turn SkyPilot's environment into the `accelerate launch` command and run it under the
progress watchdog."""

from __future__ import annotations

import argparse

from orchestrator.commands import add

EPILOG = """\
examples:
  orch node            # in a recipe's `run:`: run accelerate with this node's rank, IPs and GPU count
  orch node --print    # print that command and exit (identical env -> identical argv)
  orch node --rehearse # in a recipe's setup: the owners' code on this cluster's roles, as the model downloads
  srun orch node --recipe recipes/qwen25_sft_ddp.yaml --smoke   # Slurm (examples/slurm/orch.sbatch)

  # try it by hand: rank 1 of 2 nodes x 8 GPUs
  SKYPILOT_NODE_RANK=1 SKYPILOT_NUM_NODES=2 SKYPILOT_NUM_GPUS_PER_NODE=8 \\
  SKYPILOT_NODE_IPS=$'10.0.0.1\\n10.0.0.2' TRL_TRAINER=dpo TRL_CONFIG=recipes/trl/phi3_dpo.yaml \\
  ACCELERATE_CONFIG=recipes/accelerate/fsdp2_phi3.yaml GLOBAL_BATCH_SIZE=64 orch node --print

Where it runs, in this order: SkyPilot (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES,
SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_TASK_ID), Slurm under srun (SLURM_JOB_NODELIST, SLURM_NODEID,
SLURM_JOB_NUM_NODES, SLURM_GPUS_ON_NODE), Kubeflow's PyTorchJob (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT) or torchrun-style variables (MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES);
ORCH_GPUS_PER_NODE or CUDA_VISIBLE_DEVICES give the GPU count where the scheduler does not; ORCH_RUN_ID, when set,
is the run id (before SKYPILOT_TASK_ID and the Slurm job id). Then the recipe's envs TRL_TRAINER, TRL_CONFIG,
ACCELERATE_CONFIG, GLOBAL_BATCH_SIZE, TRL_OVERRIDES, MAIN_PROCESS_PORT, CHECKPOINT_ROOT, VLLM_SERVER_NODES,
VLLM_SERVER_PORT, DDP_TIMEOUT, OMP_NUM_THREADS (set to cores / processes when the recipe offloads to CPU);
ORCH_DEVICE=cpu runs CPU processes (the local backend sets it). Before starting, every node of a
multi-node run reports to the head (ORCH_BARRIER_PORT, ORCH_RENDEZVOUS_TIMEOUT): a node that never joins is
named. While it trains, a watchdog ends a stalled node (no step for max(10 x median step, ORCH_STALL_FLOOR=300 s);
ORCH_STALL_FIRST=1800 s before the first step; ORCH_WATCHDOG=off) after dumping every rank's stack with py-spy
into <output_dir>/orch/hang/, and exits 75. ORCH_NETCHECK=warn|error|off and ORCH_MIN_BUS_GBPS set the network
check before the model loads. Third-party notices nobody can act on are hidden and counted (shown when the node
fails, or with ORCH_SHOW_NOTICES=on).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add(
        sub,
        "node",
        help="on a node: run the accelerate launch command for this node under the progress watchdog",
        description="Build this node's `accelerate launch` command from SkyPilot's environment and run it under "
        "the progress watchdog.",
        epilog=EPILOG,
    )
    parser.add_argument("--print", action="store_true", help="print the command and exit instead of running it")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="on the head node: rehearse this cluster's roles against accelerate/TRL/transformers and exit "
        "(scripts/node-setup.sh runs it while the model downloads; reads SkyPilot's setup variables too)",
    )
    parser.add_argument(
        "--times",
        metavar="FILE",
        help="with --rehearse: append `rehearsed=<epoch seconds>` to FILE when it passes, `error=<its line>` "
        "instead of printing it when it refuses (scripts/node-setup.sh's timings file; the setup prints it)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="with --rehearse: also compile what this node's training processes import, where this environment "
        "lacks their bytecode and no rehearsal here imported them (scripts/node-setup.sh passes it when its setup "
        "installed the environment: uv writes no bytecode)",
    )
    parser.add_argument(
        "--recipe",
        metavar="FILE",
        help="take the recipe's envs from FILE (where no SkyPilot passes them: Slurm, an operator, by hand); this "
        "environment's variables win",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --recipe: the tiny model of the recipe's architecture and synthetic data, built here offline, 8 "
        "steps (check a cluster before downloading the model)",
    )
    parser.add_argument(
        "--checkpoint-now",
        action="store_true",
        help="ask this node's training processes for a checkpoint at their next step and wait for it (SkyPilot's "
        "preemption hook runs it; the run needs ORCH_SAVE_ON_REQUEST=on, which spot and managed launches get)",
    )
    parser.add_argument("--wait", type=float, default=120.0, metavar="S", help="with --checkpoint-now: seconds")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="TRL settings over the recipe's (and --smoke's), as with `orch run`; they join TRL_OVERRIDES",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import os

    from orchestrator.core.errors import OrchError
    from orchestrator.core.home import shared_caches
    from orchestrator.node import exec as node_exec

    os.environ.update(shared_caches(os.environ))  # SkyPilot on Slurm: the account's caches, not the cluster's $HOME
    if args.checkpoint_now:
        return node_exec.checkpoint_now(os.environ, args.wait)
    if args.smoke and not args.recipe:
        raise OrchError("--smoke goes with --recipe FILE (a SkyPilot node gets its smoke settings from `orch run`)")
    env = None
    if args.recipe:
        from orchestrator.node.env import with_recipe

        env = with_recipe(args.recipe, os.environ)
        if args.smoke:
            env = node_exec.smoke_env(env)
    if args.overrides:
        from orchestrator.core import overrides

        env = dict(os.environ if env is None else env)
        words = {**overrides.loads(env.get("TRL_OVERRIDES", "")), **overrides.parse(args.overrides)}
        env["TRL_OVERRIDES"] = overrides.dumps(words)
    if args.times and not args.rehearse:
        raise OrchError("--times goes with --rehearse (scripts/node-setup.sh records when the rehearsal ended)")
    if args.warm and not args.rehearse:
        raise OrchError("--warm goes with --rehearse (scripts/node-setup.sh passes both after an install)")
    if args.rehearse:
        from orchestrator.core.timeline import record

        try:
            code = node_exec.rehearse(env)
        except OrchError as exc:
            if not args.times:
                raise
            record(args.times, "error", f"orch: error: {exc}")  # node-setup.sh prints the first error once, last
            return exc.exit_code
        if code == 0:
            record(args.times, "rehearsed")
            if args.warm and node_exec.warm_up(env):
                record(args.times, "warmed")  # after the rehearsal, in the same process: the breakdown says both
        return code
    return node_exec.run(print_only=args.print, env=env)
