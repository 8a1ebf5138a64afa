"""Real servers that fail as networks do, for the remote-read tests: no client is mocked.

- `FaultServer(folder=...)` serves a folder over HTTP with Range support (Python's http.server has none);
- `FaultServer(upstream=URL)` is a proxy in front of another server (SeaweedFS's S3 endpoint): requests go
  through unchanged (the Host header too: S3 signatures cover it), responses come back unchanged.

Either one breaks the responses its `plan(n, method, path)` names: n counts the requests, and the plan
returns one of FAULTS or None (pass through). The faults:

    503           a 503 Service Unavailable, no body (S3's SlowDown is a 503 too)
    reset         headers and half the body, then a TCP reset (SO_LINGER 0)
    cut           headers with the Content-Length, half the body, then a clean close
    cut_nolength  no Content-Length (a body delimited by the close), half the body, a clean close
    stall         headers and half the body, then nothing for `stall_s`, then a close (stall_s=None: no
                  close until the server is shut down, so only the client's read timeout can end it)
    stall_forever headers, then nothing until the server is shut down
    403, 404, 408 that status with S3's error body (AccessDenied, NoSuchKey, RequestTimeout: botocore raises its
                  modeled AccessDenied and NoSuchKey classes for the first two, as for a real store; 408 Request
                  Timeout: a refusal worth a retry that botocore's own retries leave to ours, where a 503 or a 429
                  is retried inside botocore first)

`throttle_bps` slows every request body (an upload) to that many bytes per second, as a slow link would:
the proxy reads it, then waits its length / throttle_bps before passing it on.

`faults` lists (n, method, path, fault) of what was done, `log` (n, method, path, Range) every request,
`arrived[n]` the time.monotonic() at which request n came in.
"""

from __future__ import annotations

import email.utils
import http.client
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 408: "RequestTimeout", 503: "ServiceUnavailable"}
FAULTS = ("503", "reset", "cut", "cut_nolength", "stall", "stall_forever", "403", "404", "408")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}

Plan = Callable[[int, str, str], "str | None"]


def random_plan(fraction: float, seed: int = 0, kinds: tuple[str, ...] = ("503", "reset", "cut", "cut_nolength"),
                only: str = "GET") -> Plan:
    """Each `only` request fails with probability `fraction`, with a fault drawn from `kinds` (seeded)."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def plan(n: int, method: str, path: str) -> str | None:
        with lock:
            return rng.choice(kinds) if method == only and rng.random() < fraction else None

    return plan


def every_nth_plan(n: int, kinds: tuple[str, ...] = ("503", "reset", "cut", "cut_nolength"), only: str = "GET",
                   skip: Callable[[str], bool] = lambda path: False) -> Plan:
    """Every n-th `only` request (1/n of them) fails, the faults taken from `kinds` in turn: each kind
    occurs, whatever the timing. `skip(path)`: requests never failed (and not counted)."""
    counter = iter(range(1, 1 << 62))
    lock = threading.Lock()

    def plan(_: int, method: str, path: str) -> str | None:
        if method != only or skip(path):
            return None
        with lock:
            k = next(counter)
        return kinds[(k // n - 1) % len(kinds)] if k % n == 0 else None

    return plan


class FaultServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, folder: Path | None = None, upstream: str | None = None, plan: Plan | None = None,
                 stall_s: float | None = 30.0, throttle_bps: float | None = None):
        self.folder, self.upstream = folder, upstream
        self.throttle_bps = throttle_bps
        self.plan: Plan = plan or (lambda n, method, path: None)
        self.stall_s = stall_s
        self.requests = 0
        self.faults: list[tuple[int, str, str, str]] = []
        self.log: list[tuple[int, str, str, str | None]] = []  # (n, method, path, Range header) of every request
        self.arrived: dict[int, float] = {}  # n -> time.monotonic() of its arrival
        self.lock = threading.Lock()
        self.closing = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that resets or drops a connection (what the tests cause) is no news

    def stop(self) -> None:
        self.closing.set()  # ends stall_forever
        self.shutdown()
        self.server_close()

    def __enter__(self) -> FaultServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    server: FaultServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body_in = self.rfile.read(length) if length else b""
        if self.server.throttle_bps and body_in:
            self.server.closing.wait(len(body_in) / self.server.throttle_bps)  # a slow link's upload
        with self.server.lock:
            self.server.requests += 1
            n = self.server.requests
            self.server.log.append((n, method, self.path, self.headers.get("Range")))
            self.server.arrived[n] = time.monotonic()
        fault = self.server.plan(n, method, self.path)
        if fault is not None:
            with self.server.lock:
                self.server.faults.append((n, method, self.path, fault))
        if fault in ("403", "404", "408", "503"):
            return self._status(int(fault))
        status, headers, body = (self._from_upstream(method, body_in) if self.server.upstream
                                 else self._from_folder(method))
        if fault is None or method == "HEAD" or not body:
            return self._send(status, headers, body)
        half = len(body) // 2
        if fault == "cut_nolength":
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            self.close_connection = True
            self.send_response(status)
            for k, v in headers + [("Connection", "close")]:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[:half])
            self.wfile.flush()
            return
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if fault != "stall_forever":
            self.wfile.write(body[:half])
        self.wfile.flush()
        self.close_connection = True
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif fault == "stall":
            self.server.closing.wait(self.server.stall_s)
        elif fault == "stall_forever":
            self.server.closing.wait()

    def _status(self, code: int) -> None:
        # S3's own error codes: botocore raises its modeled exception classes for some (AccessDenied, NoSuchKey),
        # subclasses of ClientError, as it does for a real store's answer.
        body = f"<Error><Code>{S3_CODES[code]}</Code><Message>fault {code}</Message></Error>".encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _from_folder(self, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
        assert self.server.folder is not None
        path = self.server.folder / urlsplit(self.path).path.lstrip("/")
        if method not in ("GET", "HEAD") or not path.is_file():
            return 404, [("Content-Length", "0")], b""
        data = path.read_bytes()
        size = len(data)
        start, end = 0, size - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if start >= size:
                return 416, [("Content-Range", f"bytes */{size}"), ("Content-Length", "0")], b""
            status = 206
        body = data[start:end + 1]
        headers = [("Content-Length", str(len(body))), ("Content-Type", "application/x-tar"),
                   ("Last-Modified", email.utils.formatdate(os.stat(path).st_mtime, usegmt=True))]
        if status == 206:
            headers.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        return status, headers, body

    def _from_upstream(self, method: str, body_in: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        up = urlsplit(self.server.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            conn.request(method, self.path, body=body_in, headers=headers)
            r = conn.getresponse()
            body = r.read()
            if method == "HEAD":  # the object's length, not this empty body's
                return r.status, [(k, v) for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP], body
            out = [(k, v) for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]
            out.append(("Content-Length", str(len(body))))
            return r.status, out, body
        finally:
            conn.close()


def wait_port(host: str, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")
