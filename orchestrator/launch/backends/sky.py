"""The only module that imports SkyPilot (lazily, inside each function: `import sky` costs ~2 s).

Launch a resolved task as a cluster job (`sky.launch`) or a managed job (`sky.jobs.launch`), and map
`orch status/logs/cancel/down` onto the matching SDK calls for what the run record says was launched.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import OrchError

BACKEND_CLUSTER = "sky-cluster"
BACKEND_MANAGED = "sky-managed"


def _sky():
    try:
        import sky
    except ImportError:
        raise OrchError("SkyPilot is not installed; pip install '.[cloud]' (or use --local)") from None
    return sky


# SkyPilot's exception class name -> what to do about it (one line each).
FIXES = {
    "ApiServerConnectionError": "start the SkyPilot API server with `sky api start` (or `sky api login` to a team's)",
    "ApiServerAuthenticationError": "log in to the API server again with `sky api login`",
    "APIVersionMismatchError": "upgrade SkyPilot here or on the API server so that their versions match",
    "NoCloudAccessError": "enable a cloud with credentials: run `sky check`",
    "CloudUserIdentityError": "your cloud credentials did not work: run `sky check`",
    "ResourcesUnavailableError": "no capacity or quota for these GPUs: try another region or cloud, drop --spot, "
    "or ask the cloud for quota (`sky show-gpus` lists where they exist)",
    "ProvisionPrechecksError": "the cloud refused the request (quota, permissions): see `sky check` and your quotas",
    "ClusterNotUpError": "the cluster is not up: `orch status` shows it; relaunch with `orch run`",
    "ClusterDoesNotExist": "the cluster is gone (torn down or autostopped away): nothing to do there",
    "ClusterOwnerIdentityMismatchError": "the cluster belongs to another cloud identity: switch with `sky check`",
    "ManagedJobStatusError": "the managed job is in a state that does not allow this: `orch status` shows it",
    "NotSupportedError": "this infra lacks a feature the launch asks for (SkyPilot's reason above)",
    "PermissionDeniedError": "your SkyPilot user may not do this in that workspace",
    "NetworkError": "the network to the API server or the cloud failed: retry",
    "ServerTemporarilyUnavailableError": "the API server is busy or restarting: retry in a minute",
}


def _reason(exc: BaseException, first_line: bool = False, cap: int | None = 300) -> str:
    """SkyPilot's message on one line, uncoloured, capped (None: schema refusals end with their field); `first_line`:
    its reason alone (a table may follow)."""
    text = str(exc).strip()
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text.splitlines()[0] if first_line and text else text).split())
    return text[:cap] or type(exc).__name__


def sdk_error(what: str, exc: Exception) -> OrchError:
    """One line for a failed SDK call: what failed, SkyPilot's reason, and the fix for its kind of failure. A failed
    provisioning (ResourcesUnavailableError) quotes the first failure that was not about capacity, when there was
    one: "no capacity" would send the user after quota for an unsupported feature or a refused request."""
    causes = [c for c in getattr(exc, "failover_history", None) or [] if isinstance(c, Exception)]
    first = next((c for c in causes if type(c).__name__ != "ResourcesUnavailableError"), None)
    if first is not None:
        exc = first
    name = type(exc).__name__
    fix = next((FIXES[n] for n in [c.__name__ for c in type(exc).__mro__] if n in FIXES), "")
    if not fix and isinstance(exc, (ConnectionError, TimeoutError)):
        fix = FIXES["ApiServerConnectionError"]
    return OrchError(f"SkyPilot {what} failed: {name}: {_reason(exc)}" + (f"; {fix}" if fix else ""))


def _call(what: str, fn, *args, **kwargs):
    """An SDK call whose failure (any exception SkyPilot raises) becomes one OrchError line."""
    try:
        return fn(*args, **kwargs)
    except OrchError:
        raise
    except Exception as exc:
        raise sdk_error(what, exc) from None


def task_schema_text() -> str:
    """SkyPilot's task schema as core/sky_schema.py reads it (the launch side checks recipes without importing sky),
    with what SkyPilot validates later where it says `{type: object}`: Resources.from_yaml_config's schema and aliases
    for `resources`; Task.from_yaml_config's rule for each file mount (a path, a volume, or a bucket under Storage's),
    without their $schema (nested, it would switch jsonschema's dialect and drop SkyPilot's enum keywords)."""
    import json

    from sky import resources
    from sky.utils import schemas

    root = lambda s: {k: v for k, v in s.items() if k != "$schema"}  # noqa: E731
    schema, later = schemas.get_task_schema(), {"type": "object"}
    assert schema["properties"]["resources"] == schema["properties"]["file_mounts"] == later, "SkyPilot moved these"
    schema["properties"]["resources"] = root(schemas.get_resources_schema())
    schema["x-resource-aliases"] = dict(resources.RESOURCE_CONFIG_ALIASES)  # a keyword jsonschema ignores
    volume, bucket = {"properties": {"store": {"const": "volume"}}, "required": ["store"]}, schemas.get_storage_schema()
    schema["properties"]["file_mounts"]["additionalProperties"] = {
        "if": {"type": "object"}, "then": {"if": volume, "else": root(bucket)}, "else": {"type": "string"}}  # fmt: skip
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def to_task(task: dict, secrets: dict[str, str] | None = None):
    """A sky.Task from a task mapping; secret values go in as secrets (redacted by SkyPilot), never envs."""
    sky = _sky()
    try:
        sky_task = sky.Task.from_yaml_config(copy.deepcopy(task))
    except Exception as exc:  # SkyPilot raises ValueError / jsonschema errors with long texts
        raise OrchError(f"SkyPilot rejects the task: {_reason(exc, first_line=True, cap=None)}") from None
    if secrets:
        sky_task.update_secrets(secrets)
    return sky_task


@dataclass
class PlanResult:
    cloud: str
    region: str
    instance_type: str
    use_spot: bool
    node_dollars_per_hour: float
    nodes: int
    memory_gib: float | None = None
    """The host memory a node's job has (GiB), None when SkyPilot cannot say."""
    memory_from: str = ""
    """Where `memory_gib` comes from, or why it is unknown, in words."""

    @property
    def dollars_per_hour(self) -> float:
        return self.node_dollars_per_hour * self.nodes


def optimize(task: dict) -> PlanResult:
    """SkyPilot's own optimizer, run in this process on the local catalogs and enabled clouds.

    Raises OrchError saying why the plan could not be computed (no cloud enabled, no catalog, ...).
    """
    sky = _sky()
    from sky import sky_logging
    from sky.optimizer import Optimizer
    from sky.utils import common

    sky_task = to_task(task)
    dag = sky.Dag()
    dag.add(sky_task)
    try:
        with sky_logging.silent():  # in-process, SkyPilot would print its server-side spinner codes
            dag = Optimizer.optimize(dag, minimize=common.OptimizeTarget.COST, quiet=True)
    except Exception as exc:
        raise OrchError(f"{type(exc).__name__}: {_reason(exc, first_line=True)}") from None
    best = dag.tasks[0].best_resources
    memory_gib, memory_from = instance_memory(best)
    return PlanResult(
        cloud=str(best.cloud),
        region=str(best.region),
        instance_type=str(best.instance_type),
        use_spot=bool(best.use_spot),
        node_dollars_per_hour=float(best.get_cost(3600)),
        nodes=sky_task.num_nodes,
        memory_gib=memory_gib,
        memory_from=memory_from,
    )


def instance_memory(best) -> tuple[float | None, str]:
    """The host memory of the planned node, from SkyPilot itself: its catalog's figure for a cloud's instance type; on
    Slurm the job's `--mem` (SkyPilot's virtual instance type; Slurm enforces it where it tracks memory), or, where
    SkyPilot omits `--mem` (the cluster does not track memory), the smallest RealMemory of the cluster's nodes."""
    try:
        gib, slurm = best.cloud.get_vcpus_mem_from_instance_type(best.instance_type)[1], str(best.cloud) == "Slurm"
        if gib:
            return float(gib), (f"the Slurm job's --mem ({best.instance_type})" if slurm
                                else f"{best.instance_type} in SkyPilot's catalog")  # fmt: skip
        if not slurm:
            return None, f"SkyPilot's catalog has no memory figure for {best.instance_type}"
        from sky.provision.slurm import utils as slurm_utils

        sizes = [float(n["memory_gb"]) for n in slurm_utils.slurm_node_info(str(best.region)) if n.get("memory_gb")]
    except Exception as exc:  # noqa: BLE001 - a catalog without the row, a login node that did not answer: said
        return None, f"SkyPilot could not say the memory of {best.instance_type} ({type(exc).__name__})"
    if not sizes:
        return None, f"Slurm cluster {best.region} reports no RealMemory"
    return min(sizes), f"the smallest RealMemory of Slurm cluster {best.region} (no --mem: memory not tracked)"


def region_prices(plan: PlanResult) -> dict[str, float]:
    """The whole cluster's $/h in every region SkyPilot's catalog offers the planned instance type, keyed
    "<cloud>/<region>" as SKYPILOT_CLUSTER_INFO names them on the nodes. Failover may provision another region than
    the plan's, and a managed job's recovery yet another: the head node looks up where it really runs
    (node/price.py). Empty when the catalog cannot answer (the plan's own price still travels)."""
    from sky import catalog

    cloud = plan.cloud.lower()
    try:
        regions = catalog.get_region_zones_for_instance_type(plan.instance_type, plan.use_spot, clouds=cloud)
        return {
            f"{plan.cloud}/{r.name}": round(
                plan.nodes * catalog.get_hourly_cost(plan.instance_type, plan.use_spot, r.name, None, clouds=cloud), 4
            )
            for r in regions
        }
    except Exception:  # noqa: BLE001 - a catalog without that cloud's table: the plan's price alone
        return {}


def show_server_plan(task: dict) -> None:
    """Ask the API server's optimizer (where credentials live in a team setup); SkyPilot prints its own table of
    the chosen resources and their $/h, as `sky launch` does before its prompt."""
    sky = _sky()
    dag = sky.Dag()
    dag.add(to_task(task))
    _call("optimize", lambda: sky.stream_and_get(sky.optimize(dag)))


def launch(
    task: dict,
    secrets: dict[str, str],
    *,
    run: str,
    managed: bool,
    cluster: str,
    idle_minutes: int | None,
    down: bool,
    detach: bool,
    on_submitted,
    stream=None,
) -> int:
    """Submit, call on_submitted(meta) with the ids to record, then follow the logs unless detach (into `stream`:
    launch/job_end.Follow), answering SkyPilot's exit code of the job. A failed submission raises OrchError (the
    caller records `failed to launch`). Ctrl-C or a closed terminal while following stops following only."""
    sky = _sky()
    sky_task = to_task(task, secrets)
    if not managed:  # a managed job's controller relaunches it with these envs after each recovery: not there
        # when this submission left the laptop, for the node's time-to-first-step line (core/timeline.py): a fact of
        # the submission, like its job id, not of the task (the record keeps the task as rendered)
        sky_task.update_envs({"ORCH_LAUNCHED_AT": f"{time.time():.3f}"})
    if managed:
        job_ids, _handle = _call(
            "launch (sky jobs launch)", lambda: sky.stream_and_get(sky.jobs.launch(sky_task, name=run))
        )
        job_id = (job_ids or [None])[0]
        on_submitted({"backend": BACKEND_MANAGED, "job_id": str(job_id), "state": "submitted"})
        follow = lambda: sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=stream)  # noqa: E731
    else:
        job_id, _handle = _call(
            "launch (sky launch)",
            lambda: sky.stream_and_get(
                sky.launch(sky_task, cluster_name=cluster, idle_minutes_to_autostop=idle_minutes, down=down)
            ),
        )
        on_submitted({"backend": BACKEND_CLUSTER, "cluster": cluster, "job_id": str(job_id), "state": "submitted"})
        follow = lambda: sky.tail_logs(cluster, job_id, follow=True, output_stream=stream)  # noqa: E731
    if detach:
        print(f"[orch] detached: `orch logs {run} --follow` follows it, `orch cancel {run}` cancels it", flush=True)
        return 0
    try:
        code = _call("log streaming", follow)
    except KeyboardInterrupt:
        try:
            print(
                f"\n[orch] stopped following the logs; the job goes on: `orch logs {run} --follow` follows it again, "
                f"`orch cancel {run}` cancels it",
                flush=True,
            )
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        raise
    return int(code or 0)


def _field(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _job_id(record) -> int:
    job_id = record.get("job_id")
    if not job_id.isdigit():
        raise OrchError(
            f"run {record.run} has no job id (state: {record.get('state', '?')}): it was never submitted"
            + (f"; `orch down {record.run}` tears down its cluster if one was made" if record.get("cluster") else "")
        )
    return int(job_id)


def state(record) -> str:
    """Live state of a recorded run, as SkyPilot reports it (OrchError when SkyPilot cannot say)."""
    sky = _sky()
    backend = record.get("backend")
    if backend == BACKEND_MANAGED:  # its status, and how often SkyPilot recovered it (`RUNNING, 1 recovery`)
        job_id = _job_id(record)
        answer = _call("queue (sky jobs queue)", lambda: sky.get(sky.jobs.queue_v2(
            refresh=False, job_ids=[job_id], fields=["job_id", "status", "recovery_count"])))  # fmt: skip
        for job in answer[0] or []:  # queue_v2 answers (records, total, status counts, total without filters)
            if _field(job, "job_id") == job_id:
                status, recovered = str(_field(job, "status")).split(".")[-1], _field(job, "recovery_count") or 0
                return status + (f", {recovered} recover{'y' if recovered == 1 else 'ies'}" if recovered else "")
        return "not found"
    name = record.get("cluster")
    clusters = _call("status (sky status)", lambda: sky.get(sky.status(cluster_names=[name])))
    for cluster in clusters or []:
        status = str(_field(cluster, "status")).split(".")[-1]
        if status != "UP":
            return f"cluster {status}"
        jobs = _call("queue (sky queue)", lambda: sky.get(sky.queue(name, skip_finished=False)))
        if any(str(_field(job, "status")).split(".")[-1] in BUSY for job in jobs or []):
            return "cluster UP"
        price = _price_per_hour(cluster)
        autostop, down = _field(cluster, "autostop"), _field(cluster, "to_down")
        stops = (
            f"{'torn down' if down else 'stops'} after {autostop} idle min"
            if isinstance(autostop, int) and autostop >= 0
            else f"no autostop: `orch down {record.run}`"
        )
        return f"cluster UP, IDLE{f' at ${price:,.2f}/h' if price else ''} ({stops})"
    return "cluster down"


BUSY = ("INIT", "PENDING", "SETTING_UP", "RUNNING")


def _price_per_hour(cluster) -> float | None:
    """What an UP cluster costs per hour: its launched resources' price x its nodes (None when unknown)."""
    handle = _field(cluster, "handle")
    try:
        return float(handle.launched_resources.get_cost(3600)) * int(handle.launched_nodes)
    except Exception:  # noqa: BLE001 - an API server's handle may lack either; the state is still worth showing
        return None


def logs(record, follow: bool, stream=None, tail: int = 0) -> int:
    """Print the run's logs (its last `tail` lines when given) into `stream` (launch/job_end.Follow; None: stdout) and
    answer SkyPilot's exit code of the job."""
    sky = _sky()
    job_id = _job_id(record)
    options = {"follow": follow, "output_stream": stream, **({"tail": tail} if tail else {})}
    try:
        if record.get("backend") == BACKEND_MANAGED:
            return int(_call("logs (sky jobs logs)", lambda: sky.jobs.tail_logs(job_id=job_id, **options)) or 0)
        return int(_call("logs (sky logs)", lambda: sky.tail_logs(record.get("cluster"), job_id, **options)) or 0)
    except KeyboardInterrupt:
        if follow:
            print(f"\n[orch] stopped following; the job goes on (`orch cancel {record.run}` cancels it)", flush=True)
        raise


def recent_output(record, lines: int = 300) -> tuple[str, int]:
    """The last `lines` lines of the run's logs, without following (for `orch status RUN`), and SkyPilot's exit code
    of the job (sky.exceptions.JobExitCode)."""
    import io

    out = io.StringIO()
    code = logs(record, follow=False, stream=out, tail=lines)
    return out.getvalue(), code


def cancel(record) -> None:
    sky = _sky()
    job_id = _job_id(record)
    if record.get("backend") == BACKEND_MANAGED:
        _call("cancel (sky jobs cancel)", lambda: sky.stream_and_get(sky.jobs.cancel(job_ids=[job_id])))
    else:
        _call("cancel (sky cancel)", lambda: sky.stream_and_get(sky.cancel(record.get("cluster"), job_ids=[job_id])))


def down(record) -> None:
    sky = _sky()
    if record.get("backend") == BACKEND_MANAGED:  # SkyPilot owns the cluster of a managed job: cancel frees it
        job_id = _job_id(record)
        _call("cancel (sky jobs cancel)", lambda: sky.stream_and_get(sky.jobs.cancel(job_ids=[job_id])))
    elif record.get("cluster"):
        _call("down (sky down)", lambda: sky.stream_and_get(sky.down(record.get("cluster"))))
    else:
        raise OrchError(f"run {record.run} names no cluster (state: {record.get('state', '?')}): nothing to tear down")


def node_prices(per_node: int) -> dict[str, tuple[float, str]]:
    """Cheapest on-demand $/h of a node with `per_node` of each accelerator in SkyPilot's catalogs that are on this
    machine (the clouds whose catalog is missing are skipped: fetching it needs the network)."""
    try:
        from sky import catalog
        from sky.catalog import common
    except ImportError:
        return {}

    clouds = [c for c in ("aws", "gcp", "azure", "lambda", "runpod", "nebius") if
              Path(common.get_catalog_path(f"{c}/vms.csv")).is_file()]  # fmt: skip
    if not clouds:
        return {}
    try:
        offers = catalog.list_accelerators(gpus_only=True, quantity_filter=per_node, clouds=clouds, all_regions=True)
    except Exception:  # noqa: BLE001 - a catalog SkyPilot cannot read: no prices, said in the output
        return {}
    out: dict[str, tuple[float, str]] = {}
    for name, infos in offers.items():
        for info in infos:
            if info.price and info.price == info.price and (name not in out or info.price < out[name][0]):
                out[name] = (float(info.price), f"{info.cloud} {info.instance_type}")
    return out
