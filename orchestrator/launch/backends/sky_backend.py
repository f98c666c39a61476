"""The `sky` platform: a cluster job or a managed job through the SkyPilot SDK (its calls are in
launch/backends/sky.py, the only module that imports SkyPilot), and the answers for those runs from SkyPilot."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import slots
from orchestrator.core.accelerators import CPU
from orchestrator.core.errors import DoesNotFit, OrchError
from orchestrator.core.knobs import knob
from orchestrator.launch import job_end
from orchestrator.launch.records import Record, RunState

if TYPE_CHECKING:
    from orchestrator.launch.backends import RunOptions, RunRequest
    from orchestrator.launch.resolved import Launch

LOCAL_ONLY = ("fresh", "netns")


class SkyBackend:
    name = "sky"

    # ------------------------------------------------------------ launch

    def run(self, request: RunRequest) -> int:
        from orchestrator.core.accelerators import parse as parse_gpus
        from orchestrator.launch import placement
        from orchestrator.launch.resolved import env_notes, resolve

        options = request.options
        if any(getattr(options.local, name) for name in LOCAL_ONLY):
            raise OrchError("--fresh and --netns are for runs on this machine: add --local")
        gpus = parse_gpus(options.gpus) if options.gpus is not None else None
        placement.check_candidates(options.sky, request.recipe.task.get("resources") or {})
        cpus = gpus.count if gpus is not None and gpus.name == CPU else 0  # CPU nodes (`--gpus none`, CPU:N)
        cpu = cpus > 0
        if options.local.smoke and not cpu:
            raise OrchError(
                "--smoke trains the recipe's tiny model: on this machine (--local) or on CPU nodes (--gpus none); "
                "GPU nodes train the recipe's model"
            )
        envs = dict(request.envs)
        if cpu:  # the nodes run CPU processes (ORCH_GPUS_PER_NODE of them); with --smoke they build the tiny model
            envs.update(ORCH_DEVICE="cpu", ORCH_GPUS_PER_NODE=str(cpus))
            if options.local.smoke:
                envs["ORCH_SMOKE"] = "on"
        def launched(overrides: dict[str, str]) -> int:
            overrides = dict(overrides)  # data.use adds --data's words to it: each attempt starts from the user's own
            launch = resolve(request.recipe, nodes=options.nodes, gpus=gpus, envs=envs, trl_overrides=overrides,
                             secrets=request.secrets)  # fmt: skip
            if launch.gpus is None or launch.gpus.name is None:
                example = f"--gpus A100:{gpus.count}" if gpus else "--gpus A100:8"
                raise OrchError(f"the recipe names no accelerator in resources.accelerators; give one, e.g. {example}")
            data_file, said = None, env_notes(request.envs, launch.recipe)
            if request.data is not None:
                from orchestrator.launch import data

                data_file, launch, line = data.use(request.data, launch, False, False, overrides)
                data.check_launch(launch, options.local.smoke)
                said.append(line)
            return _launch(options, launch, request.envs, request.secrets, data_file, said)

        # the memory check, before anything was written or sent: with --auto-fit each refusal's fix (the step's batch,
        # then the evaluation's, then the generation's: each check runs once the one before it passes) is applied
        overrides, fixed = dict(request.overrides), 0
        while True:
            try:
                return launched(overrides)
            except DoesNotFit as refused:
                fixed += 1
                if not options.local.auto_fit or fixed > 3 or refused.overrides.items() <= overrides.items():
                    raise
                print(f"[orch] --auto-fit: {refused.fits}", flush=True)
                overrides = {**overrides, **refused.overrides}

    # ------------------------------------------------------------ the runs it recorded

    def state(self, record: Record, refresh: bool = False) -> str:
        """SkyPilot's live answer for a run not known to be over (kept in its record), else the recorded one. With
        `refresh`, also its progress, from the last step line in SkyPilot's logs."""
        from orchestrator.launch import progress, records
        from orchestrator.launch.backends import sky

        text = record.get("state", "?")
        if not record.get("job_id", "").isdigit() or (record.state.final and not refresh):
            return text
        try:
            if refresh:  # its logs asked beside its state: each is a request to the cluster (~2 s on the bed)
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(1) as pool:
                    lines = pool.submit(sky.recent_output, record)
                    text = sky.state(record)
                    out, code = lines.result()
                    record.meta.update(progress.from_lines(out))
                    if code == job_end.FAILED:  # a detached job that failed: why, as a followed one would say
                        record.meta["error"] = job_end.failure(record, out)
            else:
                text = sky.state(record)
        except OrchError as exc:  # SkyPilot API unreachable, no credentials, ...: the recorded state
            return f"{text} (live state unavailable: {str(exc).split(': ')[1] if ': ' in str(exc) else exc})"
        record.set_state(text)
        records.write(record)
        return text

    def progress(self, record: Record) -> dict[str, str]:
        from orchestrator.launch import progress

        return {key: record.get(key) for key in progress.KEYS}

    def logs(self, record: Record, follow: bool = False) -> int:
        from orchestrator.launch.backends import sky

        stream = job_end.Follow(sys.stdout)
        return job_end.close(record, sky.logs(record, follow=follow, stream=stream), stream, False, follow)

    def cancel(self, record: Record) -> str:
        from orchestrator.launch import records
        from orchestrator.launch.backends import sky

        sky.cancel(record)
        record.set_state(RunState.CANCELLED)
        records.write(record)
        return f"[orch] cancelled {record.run}"

    def down(self, record: Record) -> str:
        from orchestrator.launch import records
        from orchestrator.launch.backends import sky

        sky.down(record)
        cluster = record.get("cluster")
        record.set_state(RunState.DOWN if cluster else RunState.CANCELLED)
        records.write(record)
        return f"[orch] {'tore down cluster ' + cluster if cluster else 'cancelled'} ({record.run})"

    def resume(self, record: Record, options: RunOptions, given_secrets: dict[str, str]) -> int:
        """`orch run --resume RUN`: the recorded task sent again, unchanged, to the run's cluster (reused when up,
        provisioned again when gone) or as a managed job. ORCH_RUN_ID, the run's name in that task, keys the
        checkpoints, so the trainer resumes from the last complete one; the record is the same file, its job id
        the new one and `relaunches` counted."""
        from orchestrator.launch import placement, records, secrets, storage
        from orchestrator.launch.backends import sky

        flags = options.sky
        task = record.task
        envs = task.get("envs") or {}
        if envs.get("ORCH_RUN_ID") != record.run:
            raise OrchError(
                f"run {record.run} keyed its checkpoints by SkyPilot's task id (launched before orch named them by "
                f"run, or its record was edited: envs.ORCH_RUN_ID is {envs.get('ORCH_RUN_ID')!r}): a relaunch "
                f"would start from step 0; launch it again with `orch run` instead"
            )
        live = self.state(record)
        if not record.state.final and record.state not in (RunState.IDLE, RunState.STOPPED):
            raise OrchError(f"run {record.run} is {live}: `orch cancel {record.run}` stops it first (its last "
                            f"checkpoint is kept), `orch logs {record.run} --follow` follows it")  # fmt: skip
        values = secrets.for_relaunch(task, given_secrets)
        record.secrets = tuple(values.values())
        managed = record.get("backend") == sky.BACKEND_MANAGED
        cluster = record.get("cluster") or record.run
        reshaping = options.nodes is not None or options.gpus is not None
        disk = placement.relaunch_disk(flags.disk_size, reshaping, record.run)
        if reshaping:  # another shape: another cluster, the same run id
            task = _reshaped(record, options, disk)
            if not managed:
                shape = f"{task['num_nodes']}x{_accelerators(task).replace(':', '')}".lower()
                cluster = slots.check("cluster", f"{record.run}-{shape}"[:63], "the new shape's cluster name")
                print(f"[orch] cluster {cluster} for the new shape (a cluster keeps its nodes; "
                      f"{record.get('cluster') or record.run} is left as it is)", flush=True)  # fmt: skip
        sky.to_task(task, values)  # SkyPilot's own validation of the recorded file, before anything is changed
        if not flags.yes and not sys.stdin.isatty():
            raise OrchError("a relaunch asks before it spends money, but stdin is not a terminal: pass -y to launch")
        if not flags.yes:
            where = "a managed job" if managed else f"cluster {cluster}"
            answer = input(f"[orch] relaunch {record.run} on {where}? [y/N] ").strip().lower()
            if answer not in ("y", "yes"):
                print("[orch] not launched", flush=True)
                return 1
        here = records.git_commit()
        if record.get("git") and here != record.get("git"):
            print(f"[orch] note: this checkout is at {here}, the run was launched at {record.get('git')}: the nodes "
                  "get this checkout's code", flush=True)  # fmt: skip
        before = record.get("relaunches", "0")
        count = int(before) + 1 if before.isdigit() else 1
        record.set_state(RunState.LAUNCHING, relaunches=str(count), job_id="", error="",
                         relaunched=time.strftime("%Y-%m-%dT%H:%M:%S%z"))  # fmt: skip
        if task is not record.task:
            record.task = task
            record.meta["cluster"] = "" if managed else cluster
        records.write(record)
        print(f"[orch] run {record.run}: relaunch {count}, resuming from its last checkpoint "
              f"({envs.get('CHECKPOINT_ROOT', 'output_dir')}/{record.run})", flush=True)  # fmt: skip
        idle, down = placement.autostop(flags, cluster, record.run, storage.on_slurm(task))
        return _submit(record, task, values, managed, cluster, idle, down, flags.detach)

    def node_prices(self, per_node: int) -> dict[str, tuple[float, str]]:
        """SkyPilot's catalogs on this machine: the cheapest on-demand node per accelerator (`orch plan`)."""
        from orchestrator.launch.backends import sky

        return sky.node_prices(per_node)

    def output(self, record: Record, part: str, dest: Path, otherwise: str) -> Path:
        """rsync from the cluster's head node into dest (the final model's top-level files, or trackio/)."""
        from orchestrator.core.final_model import FILES
        from orchestrator.launch import storage

        if part == "final":
            rules = tuple(f"--include={pattern}" for pattern in FILES) + ("--exclude=*",)  # top-level files only
            storage.fetch_from_head(record, "", dest, rules, otherwise=otherwise)
            return dest
        storage.fetch_from_head(record, f"{part}/", dest / part, otherwise=otherwise, with_copy=", give it with --dir")
        return dest


def _launch(options: RunOptions, launch: Launch, user_envs: dict[str, str], secret_values: dict[str, str],
            data_file=None, said: list[str] | None = None) -> int:  # fmt: skip
    from orchestrator.launch import placement, records, secrets, storage
    from orchestrator.launch.backends import sky
    from orchestrator.launch.checks import check, check_output_dir, rehearse
    from orchestrator.launch.resolved import fold_setup

    flags = options.sky
    launch = launch.replace(resources=placement.resources(flags, launch))
    task = launch.task()
    slurm = storage.on_slurm(task)
    if slurm:  # no object store to mount: checkpoints on the cluster's shared home (as on-slurm.py)
        root = user_envs.get("CHECKPOINT_ROOT") or storage.SLURM_ROOT
        kept = storage.slurm_task(task, root).get("file_mounts") or {}
        dropped = {str(k): None for k in task.get("file_mounts") or {} if k not in kept}
        envs = {**{k: v for k, v in launch.envs.items() if k != "CHECKPOINT_BUCKET"}, "CHECKPOINT_ROOT": root}
        launch = launch.replace(envs=envs, mounts={**launch.mounts, **dropped})
    check_output_dir(launch)
    from orchestrator.launch import node_paths

    notes = [*(said or []), *node_paths.check(launch)]  # the data, what the nodes read: said once every check passed
    bucket, note = launch.envs.get("CHECKPOINT_BUCKET", ""), ""
    if "CHECKPOINT_BUCKET" not in user_envs and storage.shipped_bucket(bucket):
        mine = storage.personal_bucket(launch.recipe.name, storage.user_id())
        launch = launch.replace(envs={**launch.envs, "CHECKPOINT_BUCKET": mine})
        note = (
            f"[orch] checkpoints: bucket {mine} (the recipe's {bucket} is a name anyone may hold; this one is yours "
            "and the recipe's; --env CHECKPOINT_BUCKET=NAME chooses another)"
        )
    if data_file is not None:
        from orchestrator.launch import data

        launch = data.mount(launch, data_file)
    if flags.managed or flags.spot:
        launch = placement.preemption_hook(launch)
        notes += storage.unsaved_recovery(launch.settings, flags.managed)
    run = records.new_run_name(launch.recipe.name)
    cluster = flags.cluster or run
    # Batch math, parallelism, memory and env errors surface here, before anything is sent.
    cpu_nodes = launch.gpus is not None and launch.gpus.name == CPU
    checked = check(launch, device="cpu" if cpu_nodes else "gpu")
    task = launch.task()  # a view for the checks below; the task sent is rendered last, from the final launch
    nodes = launch.nodes
    reasons = {"a managed job's recovery": flags.managed, f"a run on {nodes} nodes": nodes > 1,
               "--down": flags.down}  # fmt: skip
    if any(reasons.values()):
        storage.require_durable(task, [why for why, applies in reasons.items() if applies])
    if not flags.dry_run and not flags.yes and not sys.stdin.isatty():
        raise OrchError("a cloud launch asks before it spends money, but stdin is not a terminal: pass -y to launch")
    from orchestrator.launch import dryrun

    ahead = None if flags.dry_run else dryrun.plan_ahead(launch)  # SkyPilot's optimizer, beside the rehearsal
    if flags.no_rehearsal or knob(os.environ, "ORCH_REHEARSAL", "on") == "off":
        rehearsal = "rehearsal: skipped here (--no-rehearsal); the head node rehearses in its setup"
    else:
        rehearsal = rehearse(launch, checked)  # an OrchError naming role, owner and fix stops here
    # the run's name keys its checkpoints on every node (node/env.run_id): the same at each `orch run --resume`; set
    # after the checks and the rehearsal, which see checks.PLACEHOLDER_TASK_ID (their cache outlives one run's name)
    launch = launch.replace(envs={**launch.envs, "ORCH_RUN_ID": run})
    for line in [*notes, note] if note else notes:
        print(line, flush=True)
    if flags.dry_run:
        return dryrun.show(launch, checked, flags.skip_optimizer, rehearsal)
    print(f"[orch] {rehearsal}", flush=True)
    sky.to_task(task, secret_values)  # SkyPilot's own validation, before anything is asked or written
    if not flags.yes:
        answer, plan = dryrun.confirm(launch, checked, flags.managed, ahead)
        if not answer:
            print("[orch] not launched", flush=True)
            return 1
    else:  # no question, the same checks: the cost cap, host memory at load against the planned node
        plan, reason = dryrun.planned(launch, checked, ahead)
        if reason is not None:
            print(f"[orch] {dryrun.unplanned(launch, checked, reason)}", flush=True)
    if plan is not None:  # spend on every step at the plan's price
        launch = placement.priced(launch, plan)
    if launch.envs.get("ORCH_MAX_COST") and not launch.envs.get("ORCH_PRICE_PER_HOUR"):
        launch = placement.price(launch, checked.plans[0].topology.total_gpus)
    task = fold_setup(launch.task())  # last: nothing edits it from here; the setup starts its run
    record = records.new(
        run,
        task,
        launch.recipe.path,
        secrets.redacted_command(list(options.argv), secret_values.values()),
        platform=SkyBackend.name,
        backend=sky.BACKEND_MANAGED if flags.managed else sky.BACKEND_CLUSTER,
        cluster="" if flags.managed else cluster,
        state=RunState.LAUNCHING.value,
        secrets=secret_values.values(),
    )
    path = records.write(record, create=True)
    print(
        f"[orch] run {run}: {launch.recipe.name} on {nodes} x {launch.gpus}{' (spot)' if flags.spot else ''}, "
        f"{'managed job' if flags.managed else f'cluster {cluster}'}; recorded in {path}",
        flush=True,
    )
    idle, down = placement.autostop(flags, cluster, run, slurm)
    return _submit(record, task, secret_values, flags.managed, cluster, idle, down, flags.detach)


def _accelerators(task: dict) -> str:
    return str((task.get("resources") or {}).get("accelerators") or "cpu")


def _reshaped(record: Record, options: RunOptions, disk: dict[str, int]) -> dict:
    """`orch run --resume RUN --nodes M --gpus ACC:N`: the recorded task at another shape, checked at that shape as
    any launch is (batch math, parallelism, memory: one line naming the shapes that keep the global batch otherwise);
    the same ORCH_RUN_ID, so the nodes resume its last checkpoint and reshard it (train/reshape.py)."""
    import copy

    from orchestrator.core import accelerators
    from orchestrator.launch.checks import check
    from orchestrator.launch.recipe import load
    from orchestrator.launch.resolved import resolve

    cpu = (record.task.get("envs") or {}).get("ORCH_DEVICE") == "cpu"
    if options.gpus is not None and cpu:
        raise OrchError(f"run {record.run} runs on CPU nodes: a relaunch changes their number (--nodes), not --gpus")
    gpus = accelerators.parse(options.gpus) if options.gpus is not None else None
    launch = resolve(load(str(record.path)), nodes=options.nodes, gpus=gpus)
    launch = launch.replace(resources={**launch.resources, **disk})
    check(launch, device="cpu" if cpu else "gpu")  # with the disk at the new shape (core/disk_need.py)
    was = f"{record.task.get('num_nodes') or 1} x {_accelerators(record.task)}"
    resources = {**(record.task.get("resources") or {}), **disk}
    if not cpu and launch.gpus is not None:
        resources = {**resources, "accelerators": str(launch.gpus)}
    # a new mapping (the recorded one stays as it is): only the shape differs from what was recorded
    task = {**copy.deepcopy(record.task), "num_nodes": launch.nodes, "resources": resources}
    print(f"[orch] run {record.run}: relaunch on {launch.nodes} x {_accelerators(task)} (recorded: {was}); the "
          "nodes resume its last checkpoint and reshard it", flush=True)  # fmt: skip
    return task


def _submit(record: Record, task: dict, secret_values: dict[str, str], managed: bool, cluster: str,
            idle: int | None, down: bool, detach: bool) -> int:  # fmt: skip
    """Send the task; the record follows: submitted with its ids, failed to launch with the reason, or
    interrupted before SkyPilot answered."""
    from orchestrator.launch import records
    from orchestrator.launch.backends import sky

    run = record.run

    def submitted(meta: dict) -> None:
        record.meta.update(meta)
        records.write(record)
        print(f"[orch] submitted: {', '.join(f'{k}={v}' for k, v in meta.items() if v)}", flush=True)

    stream = job_end.Follow(sys.stdout)
    try:
        code = sky.launch(task, secret_values, run=run, managed=managed, cluster=cluster, idle_minutes=idle,
                          down=down, detach=detach, on_submitted=submitted, stream=stream)  # fmt: skip
        return code if detach else job_end.close(record, code, stream)
    except OrchError as exc:
        if record.state is RunState.LAUNCHING:  # never submitted: the record says why
            record.set_state(RunState.FAILED_TO_LAUNCH, error=str(exc))
            records.write(record)
        raise
    except KeyboardInterrupt:
        if record.state is RunState.LAUNCHING:
            record.set_state(RunState.INTERRUPTED_LAUNCHING)
            records.write(record)
            print(
                f"[orch] interrupted before SkyPilot answered: the request may still provision; `orch status` and "
                f"`sky status` show it, `orch down {run}` tears it down",
                flush=True,
            )
        raise
