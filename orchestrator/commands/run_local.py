"""`orch run --local`: the run on emulated nodes (launch/backends/local.py), its record, its run lock, and the
out-of-memory fix (with --auto-fit, one retry with it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orchestrator.core.errors import OrchError

if TYPE_CHECKING:
    from orchestrator.launch.resolved import Launch

SMOKE_GLOBAL_BATCH = 16


def run(args, launch: Launch, user_envs, user_overrides, secret_values: dict[str, str]) -> int:
    """A local run; on out of memory, one line with the fix that keeps the math, and with --auto-fit one retry
    with that fix applied."""
    from orchestrator.launch import memory_fix

    result, ran = _local_once(args, launch, user_envs, user_overrides, secret_values)
    if result.returncode == 0 or not memory_fix.is_oom(result.error):
        return result.returncode
    fix = memory_fix.propose(ran.settings, ran.envs)
    print(f"[orch] out of memory: {fix.describe()}", flush=True)
    if fix.overrides is None:
        return result.returncode
    if not args.auto_fit:
        print(f"[orch] rerun with {fix.words()}, or add --auto-fit to do it by itself", flush=True)
        return result.returncode
    print(f"[orch] --auto-fit: retrying once with {fix.words()}", flush=True)
    retry = launch.replace(overrides={**launch.overrides, **fix.overrides})
    return _local_once(args, retry, user_envs, {**user_overrides, **fix.overrides}, secret_values)[0].returncode


def _local_once(args, launch: Launch, user_envs, user_overrides, secret_values: dict[str, str]):
    import contextlib
    import hashlib
    import json
    import secrets as secrets_module

    from orchestrator.core import smoke
    from orchestrator.launch import records, runlock, secrets, storage
    from orchestrator.launch.backends import local, netns
    from orchestrator.launch.checks import check

    recipe = launch.recipe
    artifacts = None
    if args.smoke:
        artifacts = smoke.plan(str(launch.setting("model_name_or_path", "")), recipe.trainer)
        envs = {
            **launch.envs,
            "GLOBAL_BATCH_SIZE": user_envs.get("GLOBAL_BATCH_SIZE", str(SMOKE_GLOBAL_BATCH)),
            "HF_HUB_OFFLINE": "0" if launch.envs.get("ORCH_PUSH_TO_HUB") else "1",  # a hub only to push the model
            "HF_DATASETS_OFFLINE": "1",
        }
        if launch.envs.get("VLLM_SERVER_NODES", "0") not in ("", "0"):
            envs["VLLM_SERVER_NODES"] = "0"
            print("[orch] smoke: no vLLM on CPU: every node trains and generates with the tiny model itself")
        # the recipe's overrides, then smoke's, then the user's key=value words
        trl = {**launch.overrides, **smoke.trl_overrides(artifacts), **user_overrides}
        launch = launch.replace(envs=envs, overrides=trl)
    elif "model_name_or_path" not in user_overrides:
        print("[orch] note: --local without --smoke trains the recipe's real model on this machine's CPU")
    # Stable for the same resolved task: rerunning a command finds (and resumes from) its checkpoints.
    shape = json.dumps([launch.task(recipe_accelerators=True), launch.nodes, launch.gpus.count], sort_keys=True)
    run = f"{recipe.name}-{hashlib.sha256(shape.encode()).hexdigest()[:8]}"
    # Checkpoints are keyed by the run id (SKYPILOT_TASK_ID locally), unless the user chose output_dir.
    root = "" if "output_dir" in user_overrides else "outputs"
    launch = launch.replace(envs={**launch.envs, "CHECKPOINT_ROOT": root})
    if recipe.task.get("file_mounts"):
        print("[orch] local: the recipe's file_mounts are not mounted; checkpoints go to outputs/")
    # The recipe's own consistency (memory is a GPU matter), batch math and env errors, before anything
    # starts: bad input builds no smoke model either.
    check(launch, task_id=run, device="cpu")
    if args.netns and (why := netns.available()):
        raise OrchError(why)
    command = secrets.redacted_command(args.argv, secret_values.values())
    output_dir = local.output_dir_of(launch, run)
    storage.check_writable(recipe.workdir / output_dir, "output_dir")
    local.prepare(launch, run, fresh=args.fresh, check_only=True)  # --fresh deletes only what orch made for the run
    lock = runlock.acquire(run, recipe.workdir / output_dir, command)  # one owner; refused while another lives
    try:
        local.prepare(launch, run, fresh=args.fresh)
        if artifacts is not None:
            smoke.ensure(artifacts)
        token = secrets_module.token_hex(8)
        record = records.new(
            run,
            launch.task(recipe_accelerators=True),  # the record stays a cloud task; its header says what ran here
            recipe.path,
            command,
            backend=f"local ({launch.nodes} emulated node(s) x {launch.gpus.count} CPU process(es))",
            state="running",
            output_dir=output_dir,
            pid=str(os.getpid()),
            token=token,
        )
        records.write(record)
        try:
            with contextlib.ExitStack() as stack:
                network = stack.enter_context(netns.Network(launch.nodes)) if args.netns else None
                result = local.launch(launch, run, secret_values, token, (lock,), network)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the nodes are stopped by now
            record.meta["state"] = f"interrupted ({getattr(exc, 'signame', 'SIGINT')})"
            records.write(record)
            raise
        except BaseException as exc:
            record.meta["state"] = f"failed ({type(exc).__name__})"
            records.write(record)
            raise
        record.meta["state"] = "succeeded" if result.returncode == 0 else f"failed (exit {result.returncode})"
        if result.returncode == 0 and result.stopped:
            record.meta.update(state="stopped early (cost cap)", stopped=result.stopped)
        if result.error:
            record.meta["error"] = result.error
        records.write(record)
        return result, launch
    finally:
        os.close(lock)
