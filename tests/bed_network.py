"""The managed-jobs bed's offline shim for SkyPilot's network check (tests/sky_bed.py SHIMS["network check"]).

Before every job status check, SkyPilot's jobs controller makes an HTTPS HEAD request to 8.8.8.8 and 1.1.1.1 and, when
neither answers below 400 with a certificate it trusts, logs `Network is not available` and checks again in 15 s,
forever (sky/jobs/controller.py, sky/backends/backend_utils.py async_check_network_connection). Offline it never sees
a job end or a node fail. The bed answers those two addresses for SkyPilot's API server only (the controller runs
inside it: consolidation mode):
- the API server runs in the login node's network namespace, where 8.8.8.8 and 1.1.1.1 are local addresses and
  `responder` answers HTTPS on them with a certificate made for the bed (`certificate`), which the API server's
  processes trust (SSL_CERT_FILE for aiohttp, REQUESTS_CA_BUNDLE for requests); nothing else on this machine does;
- the client side (sky, orch) keeps talking to 127.0.0.1:46580, which `forwarder` relays to the server's namespace.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ADDRESSES = ("8.8.8.8", "1.1.1.1")  # sky/backends/backend_utils.py _TEST_IP_LIST

RESPONDER = """
import http.server, ssl, sys

class Answer(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_response(204)
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("0.0.0.0", 443), Answer)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
server.serve_forever()
"""

FORWARDER = """
import asyncio, sys

listen_port, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()

async def relay(reader, writer):
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
    writer.close()
    upstream_writer.close()

async def main():
    server = await asyncio.start_server(relay, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for the two addresses (its own trust anchor), and its key."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "network-check.pem", directory / "network-check.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=orch SkyPilot bed network check", "-addext",
                    "subjectAltName=" + ",".join(f"IP:{a}" for a in ADDRESSES), "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True)  # fmt: skip
    return cert, key


def _started(argv: list[str], log: Path, what: str) -> subprocess.Popen:
    """argv, once it printed `ready` (its errors go to log)."""
    with open(log, "w") as errors:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the bed's {what} did not start: {log.read_text()[-1500:]}")
    return proc


def responder(prefix: list[str], namespace: str, cert: Path, key: Path, log: Path) -> subprocess.Popen:
    """The two addresses on the namespace's loopback, and an HTTPS answer on them."""
    for address in ADDRESSES:
        subprocess.run(["ip", "-n", namespace, "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    return _started([*prefix, sys.executable, "-c", RESPONDER, str(cert), str(key)], log, "network-check responder")


def forwarder(listen_port: int, host: str, port: int, log: Path) -> subprocess.Popen:
    """127.0.0.1:listen_port in this namespace, relayed to host:port."""
    return _started([sys.executable, "-c", FORWARDER, str(listen_port), host, str(port)], log, "API server relay")
