"""A stand-in for the `sky` module that records SDK calls instead of provisioning.

Task parsing stays SkyPilot's own (the real sky.Task), so what orch hands to the SDK is really validated;
every call that would reach the API server or a cloud is recorded and answered with canned values.
"""

from __future__ import annotations

import itertools
import threading
import types


class FakeSky(types.ModuleType):
    def __init__(self, real_sky):
        super().__init__("sky")
        self.Task = real_sky.Task
        self.Dag = real_sky.Dag
        self.calls: list[tuple] = []
        self._results: dict[str, object] = {}
        self._lock, self._ids = threading.Lock(), itertools.count(1)
        fake = self

        class Jobs:
            def launch(self, task, name=None, **kw):
                return fake._request(("jobs.launch", task, {"name": name, **kw}), ([42], None))

            def tail_logs(self, name=None, job_id=None, follow=True, output_stream=None, **kw):
                fake.calls.append(("jobs.tail_logs", None, {"job_id": job_id, "follow": follow}))
                if output_stream is not None:
                    output_stream.write(getattr(fake, "log_text", ""))
                return getattr(fake, "log_code", 0)  # sky.exceptions.JobExitCode: 100 FAILED, 103 CANCELLED

            def cancel(self, name=None, job_ids=None, **kw):
                return fake._request(("jobs.cancel", None, {"job_ids": job_ids}), None)

            def queue_v2(self, refresh, skip_finished=False, all_users=False, job_ids=None, fields=None, **kw):
                # (records, total, status counts, total without filters), as SkyPilot 0.14's; v1 warns it is deprecated
                job = {"job_id": 42, "status": "ManagedJobStatus.RECOVERING", "recovery_count": 1}
                return fake._request(("jobs.queue", None, {"job_ids": job_ids}), ([job], 1, {"RECOVERING": 1}, 1))

        self.jobs = Jobs()

    def _request(self, call: tuple, result) -> str:
        with self._lock:  # orch asks from several threads at once (`orch status`), as the real SDK allows
            self.calls.append(call)
            request_id = f"req-{next(self._ids)}"
            self._results[request_id] = result
        return request_id

    def stream_and_get(self, request_id):
        return self._results[request_id]

    def get(self, request_id):
        return self._results[request_id]

    def optimize(self, dag, **kw):
        return self._request(("optimize", dag, kw), dag)

    def launch(self, task, cluster_name=None, **kw):
        return self._request(("launch", task, {"cluster_name": cluster_name, **kw}), (7, None))

    def tail_logs(self, cluster_name, job_id, follow, output_stream=None, **kw):
        self.calls.append(("tail_logs", None, {"cluster_name": cluster_name, "job_id": job_id, "follow": follow}))
        if output_stream is not None:  # what the job printed (a test sets log_text)
            output_stream.write(getattr(self, "log_text", ""))
        return getattr(self, "log_code", 0)  # sky.exceptions.JobExitCode: 100 FAILED, 103 CANCELLED

    def queue(self, cluster_name, skip_finished=False, **kw):
        jobs = self.cluster_jobs if hasattr(self, "cluster_jobs") else [{"job_id": 7, "status": "JobStatus.RUNNING"}]
        return self._request(("queue", None, {"cluster_name": cluster_name}), jobs)

    def status(self, cluster_names=None, **kw):
        # as SkyPilot answers (tests/test_sky_bed.py compares the shapes): name, status, autostop minutes, to_down
        name = (cluster_names or ["c1"])[0]
        default = [{"name": name, "status": "ClusterStatus.UP", "autostop": -1, "to_down": False}]
        clusters = [{"name": name, **c} for c in self.clusters] if hasattr(self, "clusters") else default
        return self._request(("status", None, {"cluster_names": cluster_names}), clusters)

    def cancel(self, cluster_name, job_ids=None, **kw):
        return self._request(("cancel", None, {"cluster_name": cluster_name, "job_ids": job_ids}), None)

    def down(self, cluster_name, **kw):
        return self._request(("down", None, {"cluster_name": cluster_name}), None)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


# What orch reads from each answer (launch/backends/sky.py): the fake must answer with the same fields and kinds.
READ = {
    "status": ("name", "status", "autostop", "to_down"),
    "queue": ("job_id", "status"),
}


def kind(value) -> str:
    """A value's shape as orch reads it: a SkyPilot status by its enum's name, else its Python type."""
    import re

    if value is None:
        return "missing"
    text = str(value)
    if re.fullmatch(r"[A-Za-z]+Status\.[A-Z_]+", text):
        return text.split(".")[0]
    return type(value).__name__


def shapes(sky, cluster: str, states: dict | None = None) -> dict:
    """The shapes of SkyPilot's answers about a cluster with a finished job: `sky status`, `sky queue` and the exit
    code of `sky logs`. Run against the real SDK (tests/test_sky_bed.py) and against FakeSky: they must agree.
    `states`, when given, gets each job's status by name from the same queue answer."""
    import io

    def read(item, name):  # a dict (the SDK's queue) or an object with attributes (a status record)
        return item.get(name) if isinstance(item, dict) else getattr(item, name, None)

    def fields(items, what):
        item = list(items)[0]
        return {name: kind(read(item, name)) for name in READ[what]}

    jobs = sky.get(sky.queue(cluster, skip_finished=False))  # asked once: each ask is a process on the cluster's head
    if states is not None:
        for job in jobs:
            status = read(job, "status")
            states[str(read(job, "job_id"))] = getattr(status, "name", str(status))
    out = {"status": fields(sky.get(sky.status(cluster_names=[cluster])), "status"), "queue": fields(jobs, "queue")}
    job = jobs[0]
    job_id = job.get("job_id") if isinstance(job, dict) else job.job_id  # no default: a job has its id
    out["logs"] = kind(sky.tail_logs(cluster, job_id, follow=False, tail=5, output_stream=io.StringIO()))
    return out
