"""A local stand-in for the Hugging Face Hub, for tests: huggingface_hub's own client talks to it over HTTP
(HF_ENDPOINT), so downloads, caching and the Hub's errors run for real, with no network.

Serves repos saved on disk under ROOT/models/<org>/<name>/, ROOT/datasets/<org>/<name>/ and ROOT/kernels/<org>/<name>/
at revision "main" (and, for kernels, the version branches v1..v3, as the Kernels Hub names them):
  GET  /api/{models,datasets,kernels}/<repo>[/revision/<rev>]    repo info (sha, siblings)
  GET  /api/{models,datasets,kernels}/<repo>/tree/<rev>[/<path>] what is under path (?recursive=true: every file)
  GET  /api/kernels/<repo>/refs                                   branches main and v1..v3
  GET  /api/organizations/<org>/overview                          trustedKernelPublisher: org in `trusted`
  HEAD/GET /<repo>/resolve/<rev>/<file>, /{datasets,kernels}/<repo>/resolve/<rev>/<file>
A repo listed in `gated` answers 401 GatedRepo to requests without `Authorization: Bearer <token>`. `hold.clear()` makes
every file download wait until `hold.set()` (a download in flight, for as long as a test needs); `downloading` is set
when one has started.
Uploads, with the token only (else 401): POST /api/repos/create, then upload_folder's calls (/api/validate-yaml,
/api/models/<repo>/preupload/<rev> with every file "regular": inlined, no LFS, and /commit/<rev>, NDJSON), which
writes the files into the repo's folder.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0" * 40
BRANCHES = ("main", "v1", "v2", "v3")  # a kernel repo's version branches (kernels resolves version=N to vN)


# A Kernels Hub attention kernel in plain torch: flash attention's two entry points over SDPA, each document of a varlen
# batch attending only within itself, as the flash-attn builds do.
KERNEL_SOURCE = '''import torch
import torch.nn.functional as F


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                         scale=softmax_scale, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, **kwargs):
    pieces = []
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
        pieces.append(flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_p, softmax_scale,
                                      causal)[0])
    return torch.cat(pieces)
'''


def save_kernel(root: Path, repo: str, variant: str = "torch-cpu", archs: list[str] | None = None) -> None:
    """A kernel repo under ROOT/kernels/<repo>/ with one build (torch-cpu: the noarch CPU build this machine's torch
    picks; torch213-cxx11-cu130-x86_64-linux: a CUDA build it cannot use), metadata as the kernels package reads it
    (archs: the CUDA compute capabilities a build declares)."""
    build = root / "kernels" / repo / "build" / variant
    build.mkdir(parents=True)
    (build / "__init__.py").write_text(KERNEL_SOURCE)
    backend = "cpu" if variant.endswith("-cpu") else "cuda"
    metadata = {"id": f"_{repo.split('/')[1].replace('-', '_')}_0", "name": repo.split("/")[1], "version": 1,
                "license": "Apache-2.0", "python-depends": [], "backend": {"type": backend}}  # fmt: skip
    if archs:
        metadata["backend"]["archs"] = archs
    (build / "metadata.json").write_text(json.dumps(metadata))


class Hub:
    def __init__(self, root: Path, gated: set[str] = frozenset(), token: str = "hf_standin_token",
                 trusted: set[str] = frozenset({"kernels-community"}), port: int = 0):  # fmt: skip
        self.root, self.gated, self.token, self.trusted = root, set(gated), token, set(trusted)
        self.requests: list[str] = []
        self.hold, self.downloading = threading.Event(), threading.Event()
        self.hold.set()
        self.drop = 0  # the next `drop` requests get their connection closed, no answer (a link that drops)
        self.unavailable = 0  # the next `unavailable` requests get 503 (the Hub's own failure)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.hold.set()  # no handler left waiting
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, code: int, error_code: str, head: bool):
                body = json.dumps({"error": error_code}).encode()
                self._send(code, body, {"X-Error-Code": error_code, "Content-Type": "application/json"}, head)

            def _json(self, answer, head: bool):
                return self._send(200, json.dumps(answer).encode(), {"Content-Type": "application/json"}, head)

            def _route(self, head: bool):
                url = urlparse(self.path)
                path = unquote(url.path)
                hub.requests.append(f"{self.command} {path}")
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "organizations"] and parts[3:] == ["overview"]:
                    org = parts[2]
                    overview = {"name": org, "fullname": org, "trustedKernelPublisher": org in hub.trusted}
                    return self._json(overview, head)
                if parts[0] == "api":  # /api/models/org/name/revision/main
                    kind, repo, rest = parts[1], "/".join(parts[2:4]), parts[4:]
                else:  # /org/name/resolve/main/file, /datasets/org/name/resolve/main/file, /kernels/...
                    kind = parts[0] if parts[0] in ("datasets", "kernels") else "models"
                    parts = parts[1:] if kind != "models" else parts
                    repo, rest = "/".join(parts[:2]), parts[2:]
                folder = hub.root / kind / repo
                if not folder.is_dir():
                    return self._error(404, "RepoNotFound", head)
                if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401, "GatedRepo", head)
                files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
                if parts[0] == "api" and (not rest or rest[0] == "revision"):
                    info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": f} for f in files], "private": False}
                    if kind == "kernels":  # the Hub's kernel info lists no files (huggingface_hub then lists the tree)
                        del info["siblings"]
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                if parts[0] == "api" and rest[0] == "refs" and kind == "kernels":
                    branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": SHA} for b in BRANCHES]
                    return self._json({"branches": branches, "tags": [], "converts": []}, head)
                if parts[0] == "api" and rest[0] == "tree":  # /tree/<rev>[/<path>]: files, and folders unless recursive
                    under = "/".join(rest[2:])
                    prefix, recursive = f"{under}/" if under else "", "recursive=true" in url.query.lower()
                    inside = [f[len(prefix):] for f in files if f.startswith(prefix)]
                    tree = [{"type": "file", "path": prefix + f, "size": (folder / prefix / f).stat().st_size,
                             "oid": SHA} for f in inside if recursive or "/" not in f]  # fmt: skip
                    if not recursive:
                        folders = sorted({f.split("/")[0] for f in inside if "/" in f})
                        tree += [{"type": "directory", "path": prefix + d, "oid": SHA} for d in folders]
                    return self._json(tree, head)
                if rest[0] == "resolve":
                    target = folder / "/".join(rest[2:])
                    if not target.is_file():
                        return self._error(404, "EntryNotFound", head)
                    if not head:
                        hub.downloading.set()
                        hub.hold.wait(timeout=300)
                    data = target.read_bytes()
                    etag = hashlib.sha256(data).hexdigest()
                    headers = {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
                    return self._send(200, data, headers, head)
                return self._error(404, "EntryNotFound", head)

            def _safe(self, head: bool):
                with hub.lock:
                    dropped, hub.drop = hub.drop > 0, max(0, hub.drop - 1)
                    failed = not dropped and hub.unavailable > 0
                    hub.unavailable -= failed
                if failed or dropped:
                    hub.requests.append(f"{'503' if failed else 'dropped'} {self.command} "
                                        f"{unquote(urlparse(self.path).path)}")  # fmt: skip
                if failed:
                    return self._error(503, "ServiceUnavailable", head)
                if dropped:
                    self.close_connection = True
                    return
                try:
                    self._route(head)
                except (IndexError, ValueError):
                    self._error(404, "EntryNotFound", head)
                except (BrokenPipeError, ConnectionResetError):  # a client stopped mid-download (a test's point)
                    pass

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"POST {path}")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401, "Unauthorized", False)
                parts = path.strip("/").split("/")
                ok = {"Content-Type": "application/json"}
                if parts[:3] == ["api", "repos", "create"]:
                    spec = json.loads(body)
                    repo = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
                    (hub.root / "models" / repo).mkdir(parents=True, exist_ok=True)
                    return self._send(200, json.dumps({"url": f"{hub.endpoint}/{repo}"}).encode(), ok)
                if parts[:2] == ["api", "validate-yaml"]:  # a README.md's model card metadata, checked before a commit
                    return self._send(200, b"{}", ok)
                if len(parts) < 5:
                    return self._error(404, "EntryNotFound", False)
                kind, repo, action = parts[1], "/".join(parts[2:4]), parts[4]
                folder = hub.root / kind / repo
                if not folder.is_dir():
                    return self._error(404, "RepoNotFound", False)
                if action == "preupload":
                    files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                             for f in json.loads(body)["files"]]  # fmt: skip
                    return self._send(200, json.dumps({"files": files}).encode(), ok)
                if action == "commit":
                    import base64

                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            target = folder / item["value"]["path"]
                            target.parent.mkdir(parents=True, exist_ok=True)
                            target.write_bytes(base64.b64decode(item["value"]["content"]))
                    answer = {"commitUrl": f"{hub.endpoint}/{repo}/commit/{SHA}", "commitOid": SHA}
                    return self._send(200, json.dumps(answer).encode(), ok)
                return self._error(404, "EntryNotFound", False)

            def do_GET(self):
                self._safe(head=False)

            def do_HEAD(self):
                self._safe(head=True)

        return Handler
