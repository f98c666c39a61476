"""The `local` platform: runs on emulated nodes on this machine (launch/backends/local.py runs them), their records,
run locks and out-of-memory fix (with --auto-fit, one retry with it), and the answers for them: state from the run
lock, progress and logs from the run's output dir, cancel and down by SIGTERM to the run's orch."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import resume_from
from orchestrator.core.errors import OrchError
from orchestrator.launch.records import Record, RunState

if TYPE_CHECKING:
    from orchestrator.launch.backends import RunOptions, RunRequest
    from orchestrator.launch.resolved import Launch

SMOKE_GLOBAL_BATCH = 16


class LocalBackend:
    name = "local"

    # ------------------------------------------------------------ launch

    def run(self, request: RunRequest) -> int:
        """A local run; on out of memory, one line with the fix that keeps the math, and with --auto-fit one retry
        with that fix applied."""
        import dataclasses

        from orchestrator.core import memory_fix
        from orchestrator.core.accelerators import CPU, Gpus
        from orchestrator.core.accelerators import parse as parse_gpus
        from orchestrator.core.knobs import check_knobs
        from orchestrator.launch.backends import SkyOptions
        from orchestrator.launch.resolved import env_notes, resolve

        options = request.options
        given = [f.name for f in dataclasses.fields(SkyOptions)
                 if f.name != "yes" and getattr(options.sky, f.name) != f.default]  # fmt: skip
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise OrchError(f"{flags}: for SkyPilot launches, not --local (drop {'it' if len(given) == 1 else 'them'})")
        check_knobs(os.environ)  # the local nodes inherit this environment: its knobs are refused here, not in a node
        gpus = parse_gpus(options.gpus) if options.gpus is not None else None
        if gpus and gpus.name not in (None, CPU):
            raise OrchError(f"--gpus {options.gpus}: --local runs CPU processes; use --gpus CPU:{gpus.count}")
        launch = resolve(request.recipe, nodes=options.nodes, gpus=Gpus(CPU, gpus.count if gpus else 1),
                         envs=request.envs, trl_overrides=request.overrides, secrets=request.secrets)  # fmt: skip
        said = env_notes(request.envs, launch.recipe)  # lines said once every check passed
        if request.data is not None:
            from orchestrator.launch import data

            _, launch, line = data.use(request.data, launch, True, options.local.smoke, request.overrides)
            data.check_launch(launch, options.local.smoke)
            said.append(line)
        result, ran = _local_once(options, launch, request.envs, request.overrides, request.secrets, said)
        if result.returncode == 0 or not memory_fix.is_oom(result.error):
            return result.returncode
        from orchestrator.core.strategy import parallel_sizes

        sizes = parallel_sizes(ran.paired.accelerate, "cpu", ran.total_gpus)  # as the local nodes planned it
        fix = memory_fix.propose(ran.settings, ran.envs, ran.total_gpus, sizes)
        print(f"[orch] out of memory: {fix.describe()}", flush=True)
        if fix.overrides is None:
            return result.returncode
        if not options.local.auto_fit:
            print(f"[orch] rerun with {fix.words()}, or add --auto-fit to do it by itself", flush=True)
            return result.returncode
        print(f"[orch] --auto-fit: retrying once with {fix.words()}", flush=True)
        retry = launch.replace(overrides={**launch.overrides, **fix.overrides})
        overrides = {**request.overrides, **fix.overrides}
        return _local_once(options, retry, request.envs, overrides, request.secrets)[0].returncode

    # ------------------------------------------------------------ the runs it recorded

    def state(self, record: Record, refresh: bool = False) -> str:
        """A recorded `running` whose lock nobody holds lost its orch (SIGKILL, a crash): what is left of it is killed
        (processes carrying its launch token) and the record says so."""
        from orchestrator.launch import records, runlock

        if record.state is not RunState.RUNNING or runlock.held(_output_dir(record)):
            return record.get("state", "?")
        reaped = runlock.reap(record.get("token"))
        record.set_state(RunState.INTERRUPTED, f"orch pid {record.get('pid', '?')} ended without recording it" + (
            f"; reaped {len(reaped)} leftover process(es)" if reaped else "; no process of it was left"))  # fmt: skip
        records.write(record)
        return record.get("state")

    def progress(self, record: Record) -> dict[str, str]:
        from orchestrator.launch import progress

        return progress.from_log(_output_dir(record) / "orch" / "log.jsonl")

    def logs(self, record: Record, follow: bool = False) -> int:
        """The run's log (run.log, what its orch printed); `follow`: as it grows, until the run's orch and nodes are
        gone. A run that is over and did not succeed ends with its state (a failure's log already ends with its first
        real error) and exits 1, as `orch logs` of a failed cloud job does."""
        import time

        from orchestrator.launch import records, runlock

        log = _output_dir(record) / "orch" / "run.log"
        if not log.is_file():
            raise OrchError(f"run {record.run} has no log at {log}; rerun it with `{record.get('command')}`")
        with open(log, errors="replace") as fh:
            while True:
                live = runlock.held(_output_dir(record))  # asked before reading: its last lines come before it ends
                sys.stdout.write(fh.read())
                sys.stdout.flush()
                if not (follow and live):
                    break
                time.sleep(0.5)
        if live:
            return 0
        state = self.state(records.read(record.path) if record.path.is_file() else record)
        if RunState.of(state) in (RunState.SUCCEEDED, RunState.STOPPED_EARLY, RunState.RUNNING):
            return 0
        print(f"[orch] run {record.run}: {state}", flush=True)
        return 1

    def cancel(self, record: Record) -> str:
        return _stop(self, record, "cancel")

    def down(self, record: Record) -> str:
        return _stop(self, record, "tear down")

    def output(self, record: Record, part: str, dest: Path, otherwise: str) -> Path:
        return _output_dir(record)


def _output_dir(record: Record) -> Path:
    """The run's output dir: absolute in records from this version on; earlier ones wrote it relative to the
    directory orch ran in (the repository root, as a rule)."""
    return Path(record.get("output_dir"))


def _stop(backend: LocalBackend, record: Record, verb: str) -> str:
    """cancel/down of a local run: SIGTERM to its orch, which stops every node and records `interrupted`."""
    import signal
    import time

    from orchestrator.launch import runlock

    state = backend.state(record)
    if record.state is not RunState.RUNNING:
        raise OrchError(f"run {record.run} ran locally and is not running ({state}): there is nothing to {verb}")
    pid = int(record.get("pid"))
    os.kill(pid, signal.SIGTERM)
    print(f"[orch] sent SIGTERM to orch (pid {pid}) of {record.run}; it stops its nodes", flush=True)
    deadline = time.monotonic() + 30
    while runlock.held(_output_dir(record)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if runlock.held(_output_dir(record)):
        raise OrchError(f"run {record.run} is still stopping after 30 s; `orch status` shows when it has ended")
    return f"[orch] stopped {record.run}"


def _smoke(launch: Launch, user_envs: dict[str, str], user_overrides: dict[str, str]):
    """The launch pointed at the tiny artifacts of the recipe's family (built later, after every check)."""
    from orchestrator.core import bnb, smoke
    from orchestrator.node import model_config

    model = str(launch.setting("model_name_or_path", ""))
    family = model_config.family(model, launch.setting("model_revision"))  # its config.json's model_type, or its name
    artifacts = smoke.plan(model, launch.recipe.trainer, family=family)
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
    trl = {**launch.overrides, **smoke.trl_overrides(artifacts, launch.settings), **user_overrides}
    smoked = launch.replace(envs=envs, overrides=trl)
    if not bnb.uses(smoked.setting):  # the ranks run without it, as nodes without the quant extra do (core/bnb.py)
        smoked = smoked.replace(envs={**envs, bnb.ENV: "off"})
    return smoked, artifacts


def _check_local_paths(launch: Launch, given: dict[str, str] | None = None) -> None:
    """A model or dataset given as a path (/..., ./..., ../..., ~/...) that is not on this machine, where a local run's
    ranks load it: they would take it for a Hub id and fail after the launch on the Hub's answer, or on its absence. A
    dataset_name that is one file: TRL's `load_dataset(dataset_name)` reads a Hub id or a directory, and said only
    "Couldn't find any data file" after the launch. `given`: only these settings (the user's, in a smoke run)."""
    setting = given.get if given is not None else launch.setting
    for key in ("model_name_or_path", "dataset_name"):
        value = str(setting(key, "") or "")
        if not value.startswith(("/", "./", "../", "~")):
            continue
        path = launch.recipe.workdir / os.path.expanduser(value)
        if not path.exists():
            raise OrchError(f"{key}={value}: no such file or directory here ({path}), where a local run's ranks load "
                            "it; give an existing path, or a Hub id (org/name)")  # fmt: skip
        if key == "model_name_or_path" and path.is_file():
            raise OrchError(
                f"model_name_or_path={value} is a file: transformers loads a model from a directory (config.json and "
                "the weights) or a Hub id; give the model's directory"
            )
        if key == "dataset_name" and path.is_file():
            raise OrchError(f"dataset_name={value} is a file: TRL loads dataset_name as a Hub id or a directory of "
                            f"data files; give the file with --data {value} (its rows are checked against the "
                            "trainer's columns first)")  # fmt: skip
    resume = str(setting("resume_from_checkpoint", "") or "")  # read by the ranks as given, relative or not
    if resume and (why := resume_from.problem(resume, launch.recipe.workdir / os.path.expanduser(resume))):
        raise OrchError(why)


# What an emulated node holds at least, measured (2026-12-06, a 2-node smoke run's resident sets): its accelerate
# launcher 0.23 GiB, each training process 0.53 GiB with the stack imported and a tiny model; a real model adds its own.
NODE_GIB, RANK_GIB = 0.22, 0.5


def _fits_here(nodes: int, per_node: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Every emulated node is processes of this machine: `--local --nodes 64` (a cloud command with --local added)
    started 64 launchers and ranks, ~51 GiB, and the kernel's OOM killer chose among this machine's processes. Refused
    when even the floor above exceeds the memory available now (never a run that would fit)."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.M)
    except OSError:
        return
    if found is None:
        return
    available = int(found.group(1)) / 2**20
    floor = nodes * (NODE_GIB + RANK_GIB * per_node)
    if floor > available:
        raise OrchError(f"--local: {nodes} emulated node(s) x {per_node} process(es) hold {floor:.1f} GiB at least "
                        f"(a launcher {NODE_GIB} GiB a node, {RANK_GIB} GiB a training process), and this machine has "
                        f"{available:.1f} GiB available: use fewer --nodes or processes (--gpus CPU:N)")  # fmt: skip


NOT_IDENTITY = ("ORCH_RESUME_CHANGED", "ORCH_MAX_COST", "ORCH_PRICE_PER_HOUR")
"""Envs that change how a run is resumed, capped or priced, never what it trains: not part of a local run's name."""


def _local_once(options: RunOptions, launch: Launch, user_envs, user_overrides, secret_values: dict[str, str],
                said: list[str] | None = None):  # fmt: skip
    import contextlib
    import hashlib
    import json
    import secrets as secrets_module

    from orchestrator.core import smoke
    from orchestrator.launch import records, runlock, secrets, storage
    from orchestrator.launch.backends import local, netns
    from orchestrator.launch.checks import check

    recipe = launch.recipe
    artifacts, notes = None, list(said or [])  # said once every check passed: a refused launch says one line only
    if options.local.smoke:
        launch, artifacts = _smoke(launch, user_envs, user_overrides)
    elif "model_name_or_path" not in user_overrides:
        notes.append("[orch] note: --local without --smoke trains the recipe's real model on this machine's CPU")
    # Stable for the same resolved task at any shape: rerunning a command, with other --nodes or --gpus too, finds
    # (and resumes from) its checkpoints; the node reshards them where the world size changed (train/reshape.py).
    same = launch.replace(envs={k: v for k, v in launch.envs.items() if k not in NOT_IDENTITY})  # the same run
    task = {k: v for k, v in same.task(recipe_accelerators=True).items() if k != "num_nodes"}
    run = f"{recipe.name}-{hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:8]}"
    # Checkpoints are keyed by the run id (SKYPILOT_TASK_ID locally), unless the user chose output_dir.
    root = "" if "output_dir" in user_overrides else "outputs"
    launch = launch.replace(envs={**launch.envs, "CHECKPOINT_ROOT": root})
    if recipe.task.get("file_mounts"):
        notes.append("[orch] local: the recipe's file_mounts are not mounted; checkpoints go to outputs/")
    # The recipe's own consistency (memory is a GPU matter), batch math and env errors, before anything
    # starts: bad input builds no smoke model either.
    check(launch, task_id=run, device="cpu")
    # a smoke run's tiny model and data are built after the checks: only what the user gave is checked there
    _check_local_paths(launch, user_overrides if artifacts is not None else None)
    if options.local.netns and (why := netns.available()):
        raise OrchError(why)
    _fits_here(launch.nodes, launch.gpus_per_node)
    command = secrets.redacted_command(list(options.argv), secret_values.values())
    output_dir = local.output_dir_of(launch, run)
    storage.check_writable(recipe.workdir / output_dir, "output_dir")
    local.prepare(launch, run, fresh=options.local.fresh, check_only=True)  # --fresh deletes only what orch made for it
    lock = runlock.acquire(run, recipe.workdir / output_dir, command)  # one owner; refused while another lives
    for note in notes:
        print(note, flush=True)
    try:
        local.prepare(launch, run, fresh=options.local.fresh)
        if artifacts is not None:
            smoke.ensure(artifacts)
        token = secrets_module.token_hex(8)
        record = records.new(
            run,
            launch.task(recipe_accelerators=True),  # the record stays a cloud task; its header says what ran here
            recipe.path,
            command,
            platform=LocalBackend.name,
            backend=f"local ({launch.nodes} emulated node(s) x {launch.gpus_per_node} CPU process(es))",
            state=RunState.RUNNING.value,
            output_dir=str((recipe.workdir / output_dir).resolve()),
            pid=str(os.getpid()),
            token=token,
            secrets=secret_values.values(),
        )
        records.write(record)
        try:
            with contextlib.ExitStack() as stack:
                network = stack.enter_context(netns.Network(launch.nodes)) if options.local.netns else None
                result = local.launch(launch, run, secret_values, token, (lock,), network)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the nodes are stopped by now
            record.set_state(RunState.INTERRUPTED, getattr(exc, "signame", "SIGINT"))
            records.write(record)
            raise
        except BaseException as exc:
            record.set_state(RunState.FAILED, type(exc).__name__)
            records.write(record)
            raise
        if result.returncode != 0:
            record.set_state(RunState.FAILED, f"exit {result.returncode}")
        elif result.stopped:
            record.set_state(RunState.STOPPED_EARLY, "cost cap", stopped=result.stopped)
        else:
            record.set_state(RunState.SUCCEEDED)
        if result.error:
            record.meta["error"] = result.error
        records.write(record)
        return result, launch
    finally:
        os.close(lock)
