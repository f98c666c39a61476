"""The only module that imports SkyPilot (lazily, inside each function: `import sky` costs ~2 s).

Launch a resolved task as a cluster job (`sky.launch`) or a managed job (`sky.jobs.launch`), and map
`orch status/logs/cancel/down` onto the matching SDK calls for what the run record says was launched.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from orchestrator.core.errors import OrchError

BACKEND_CLUSTER = "sky-cluster"
BACKEND_MANAGED = "sky-managed"


def _sky():
    try:
        import sky
    except ImportError:
        raise OrchError("SkyPilot is not installed; pip install '.[cloud]' (or use --local)") from None
    return sky


def to_task(task: dict, secrets: dict[str, str] | None = None):
    """A sky.Task from a task mapping; secret values go in as secrets (redacted by SkyPilot), never envs."""
    sky = _sky()
    try:
        sky_task = sky.Task.from_yaml_config(copy.deepcopy(task))
    except Exception as exc:  # SkyPilot raises ValueError / jsonschema errors with long texts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OrchError(f"SkyPilot rejects the task: {first}") from None
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
        import re

        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = re.sub(r"\x1b\[[0-9;]*m", "", reason)  # SkyPilot colours its messages
        raise OrchError(f"{type(exc).__name__}: {reason[:300]}") from None
    best = dag.tasks[0].best_resources
    return PlanResult(
        cloud=str(best.cloud),
        region=str(best.region),
        instance_type=str(best.instance_type),
        use_spot=bool(best.use_spot),
        node_dollars_per_hour=float(best.get_cost(3600)),
        nodes=sky_task.num_nodes,
    )


def show_server_plan(task: dict) -> None:
    """Ask the API server's optimizer (where credentials live in a team setup); SkyPilot prints its own table of
    the chosen resources and their $/h, as `sky launch` does before its prompt."""
    sky = _sky()
    try:
        dag = sky.Dag()
        dag.add(to_task(task))
        sky.stream_and_get(sky.optimize(dag))
    except OrchError:
        raise
    except Exception as exc:  # no API server, no enabled cloud, ...
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise OrchError(f"{type(exc).__name__}: {reason}") from None


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
) -> int:
    """Submit, call on_submitted(meta) with the ids to record, then follow the logs unless detach."""
    sky = _sky()
    sky_task = to_task(task, secrets)
    if managed:
        job_ids, _handle = sky.stream_and_get(sky.jobs.launch(sky_task, name=run))
        job_id = (job_ids or [None])[0]
        on_submitted({"backend": BACKEND_MANAGED, "job_id": str(job_id), "state": "submitted"})
        if detach:
            return 0
        code = sky.jobs.tail_logs(job_id=job_id, follow=True)
    else:
        job_id, _handle = sky.stream_and_get(
            sky.launch(sky_task, cluster_name=cluster, idle_minutes_to_autostop=idle_minutes, down=down)
        )
        on_submitted({"backend": BACKEND_CLUSTER, "cluster": cluster, "job_id": str(job_id), "state": "submitted"})
        if detach:
            return 0
        code = sky.tail_logs(cluster, job_id, follow=True)
    return int(code or 0)


def _field(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def state(record) -> str:
    """Live state of a recorded run, as SkyPilot reports it."""
    sky = _sky()
    backend = record.get("backend")
    if backend == BACKEND_MANAGED:
        job_id = int(record.get("job_id"))
        jobs = sky.get(sky.jobs.queue(refresh=False, job_ids=[job_id]))
        for job in jobs or []:
            if _field(job, "job_id") == job_id:
                return str(_field(job, "status")).split(".")[-1]
        return "not found"
    clusters = sky.get(sky.status(cluster_names=[record.get("cluster")]))
    for cluster in clusters or []:
        return f"cluster {str(_field(cluster, 'status')).split('.')[-1]}"
    return "cluster down"


def logs(record, follow: bool) -> int:
    sky = _sky()
    job_id = record.get("job_id")
    if record.get("backend") == BACKEND_MANAGED:
        return int(sky.jobs.tail_logs(job_id=int(job_id), follow=follow) or 0)
    return int(sky.tail_logs(record.get("cluster"), int(job_id) if job_id.isdigit() else None, follow=follow) or 0)


def cancel(record) -> None:
    sky = _sky()
    if record.get("backend") == BACKEND_MANAGED:
        sky.stream_and_get(sky.jobs.cancel(job_ids=[int(record.get("job_id"))]))
    else:
        sky.stream_and_get(sky.cancel(record.get("cluster"), job_ids=[int(record.get("job_id"))]))


def down(record) -> None:
    sky = _sky()
    if record.get("backend") == BACKEND_MANAGED:  # SkyPilot owns the cluster of a managed job: cancel frees it
        sky.stream_and_get(sky.jobs.cancel(job_ids=[int(record.get("job_id"))]))
    else:
        sky.stream_and_get(sky.down(record.get("cluster")))
