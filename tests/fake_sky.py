"""A stand-in for the `sky` module that records SDK calls instead of provisioning.

Task parsing stays SkyPilot's own (the real sky.Task), so what orch hands to the SDK is really validated;
every call that would reach the API server or a cloud is recorded and answered with canned values.
"""

from __future__ import annotations

import types


class FakeSky(types.ModuleType):
    def __init__(self, real_sky):
        super().__init__("sky")
        self.Task = real_sky.Task
        self.Dag = real_sky.Dag
        self.calls: list[tuple] = []
        self._results: dict[str, object] = {}
        fake = self

        class Jobs:
            def launch(self, task, name=None, **kw):
                return fake._request(("jobs.launch", task, {"name": name, **kw}), ([42], None))

            def tail_logs(self, name=None, job_id=None, follow=True, output_stream=None, **kw):
                fake.calls.append(("jobs.tail_logs", None, {"job_id": job_id, "follow": follow}))
                if output_stream is not None:
                    output_stream.write(getattr(fake, "log_text", ""))
                return 0

            def cancel(self, name=None, job_ids=None, **kw):
                return fake._request(("jobs.cancel", None, {"job_ids": job_ids}), None)

            def queue(self, refresh, skip_finished=False, all_users=False, job_ids=None, **kw):
                return fake._request(
                    ("jobs.queue", None, {"job_ids": job_ids}),
                    [{"job_id": 42, "status": "ManagedJobStatus.RECOVERING"}],
                )

        self.jobs = Jobs()

    def _request(self, call: tuple, result) -> str:
        self.calls.append(call)
        request_id = f"req-{len(self.calls)}"
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
        return 0

    def queue(self, cluster_name, skip_finished=False, **kw):
        jobs = self.cluster_jobs if hasattr(self, "cluster_jobs") else [{"job_id": 7, "status": "JobStatus.RUNNING"}]
        return self._request(("queue", None, {"cluster_name": cluster_name}), jobs)

    def status(self, cluster_names=None, **kw):
        clusters = self.clusters if hasattr(self, "clusters") else [{"status": "ClusterStatus.UP"}]
        return self._request(("status", None, {"cluster_names": cluster_names}), clusters)

    def cancel(self, cluster_name, job_ids=None, **kw):
        return self._request(("cancel", None, {"cluster_name": cluster_name, "job_ids": job_ids}), None)

    def down(self, cluster_name, **kw):
        return self._request(("down", None, {"cluster_name": cluster_name}), None)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]
