"""The processes of a run and what drives them: the bench upstream (and OTLP sink), nginx (its
generated configuration), `stepguard serve`, wrk (its generated script, its output parsed) and
the open-loop client. `Bench.close()` stops every process started and removes the temp dir."""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from stepguard.bench.harness import free_port
from stepguard.bench.procstat import children
from stepguard.bench.proxy_setup import MOUNT, RUN_HEADER, BenchError, BenchOptions, write_contract

__all__ = ["WARMUP_S", "Bench", "Proc", "count_events", "http_call", "nginx_conf", "parse_wrk",
           "wrk_script"]

WARMUP_S = 0.5
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


def _tail(path: Path, lines: int = 8) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


def http_call(port: int, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stop_signal: int = signal.SIGTERM
    admin_port: int | None = None     # stepguard's admin listener (its /metrics)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        return [self.pid, *children(self.pid)]

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise BenchError(f"{self.name} exited with {self.popen.returncode}: {_tail(self.log)}")


class Bench:
    """The temp dir and every process started; `close()` stops them all and removes the dir."""

    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.dir = Path(tempfile.mkdtemp(prefix="stepguard-bench-"))
        self.procs: list[Proc] = []
        self.upstream_port = 0
        self.sink_url: str | None = None    # the OTLP sink of the contract_traced row
        self.round = 0          # --repeat: each round's hops get files of their own

    def tagged(self, name: str) -> str:
        return name if self.round == 0 else f"{name}-r{self.round + 1}"

    # processes -------------------------------------------------------------------------------

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              stop_signal: int = signal.SIGTERM, stdout: int | None = None) -> Proc:
        log = self.dir / f"{self.tagged(name)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     stdout=stdout if stdout is not None else out, stderr=out,
                                     env=env, cwd=self.dir)
        proc = Proc(name, popen, log, stop_signal)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        if proc in self.procs:
            self.procs.remove(proc)
        popen = proc.popen
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(proc.stop_signal)
            try:
                popen.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(_STOP_TIMEOUT_S)
        if popen.stdout is not None:
            popen.stdout.close()

    def close(self) -> None:
        try:
            for proc in reversed(list(self.procs)):
                with contextlib.suppress(Exception):
                    self.stop(proc)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def own_pids(self) -> list[int]:
        """The bench's own servers running now: the upstream and the OTLP sink."""
        return [p.pid for p in self.procs if p.name in ("upstream", "otlp-sink")]

    # the upstream, nginx, stepguard -----------------------------------------------------------

    def start_upstream(self, name: str = "upstream", items: int | None = None) -> str:
        """The bench upstream (`bench/upstream.py`); `items`: line items of its order answer
        (its default when None)."""
        proc = self.spawn(name, [sys.executable, "-m", "stepguard.bench.upstream", "--port", "0",
                                 *(["--items", str(items)] if items is not None else [])],
                          stdout=subprocess.PIPE)
        assert proc.popen.stdout is not None
        line = _readline(proc.popen.stdout, _READY_TIMEOUT_S)
        match = re.fullmatch(rb"listening (\d+)\s*", line)
        if not match:
            proc.check_alive()
            raise BenchError(f"the bench {name} did not start: {line!r} {_tail(proc.log)}")
        if name == "upstream":
            self.upstream_port = int(match.group(1))
        return f"http://127.0.0.1:{int(match.group(1))}"

    def otlp_sink(self) -> str:
        """The OTLP/HTTP endpoint traced rows export to (started once, kept for the run)."""
        if self.sink_url is None:
            self.sink_url = self.start_upstream("otlp-sink")
        return self.sink_url

    def start_nginx(self) -> tuple[Proc, int]:
        binary = self.options.nginx
        if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
            raise FileNotFoundError(f"nginx not found at {binary} (apt-get install -y nginx-light)")
        root = self.dir / self.tagged("nginx")
        root.mkdir()
        if os.geteuid() == 0:                  # workers run as nobody: let them reach their dirs
            self.dir.chmod(0o711)
            root.chmod(0o711)
        port = free_port()
        conf = root / "nginx.conf"
        conf.write_text(nginx_conf(root, port, self.upstream_port))
        proc = self.spawn("nginx", [binary, "-c", str(conf), "-p", str(root), "-e",
                                    str(root / "error.log")], stop_signal=signal.SIGQUIT)
        self._wait_http(proc, port, f"{MOUNT}/healthz", "GET")
        return proc, port

    def start_stepguard(self, name: str, contract: dict[str, Any],
                        otel: dict[str, str] | None = None, workers: int = 1,
                        store_url: str | None = None,
                        settings: dict[str, str] | None = None) -> tuple[Proc, int, Path | None]:
        """`stepguard serve` on a SQLite file of its own, or on `store_url` (a database);
        `settings`: STEPGUARD_* variables it is started with."""
        path = write_contract(self.dir / f"{self.tagged(name)}.contract.yaml", contract)
        port, admin = free_port(), free_port()
        store = None if store_url else self.dir / f"{self.tagged(name)}.db"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("STEPGUARD_", "OTEL_"))} | (otel or {}) | (settings or {})
        proc = self.spawn(name, [sys.executable, "-m", "stepguard.proxy.cli", "serve",
                                 "--contract", str(path), "--host", "127.0.0.1", "--port", str(port),
                                 "--admin-host", "127.0.0.1", "--admin-port", str(admin),
                                 "--store", store_url or str(store), "--log-level", "warning",
                                 "--workers", str(workers)],
                          env=env)
        self._wait_http(proc, admin, "/readyz", "GET")
        proc.admin_port = admin
        return proc, port, store

    def _wait_http(self, proc: Proc, port: int, path: str, method: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            proc.check_alive()
            try:
                status, _, _ = http_call(port, method, path, timeout=1.0)
                if status == 200:
                    return
                last = f"status {status}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise BenchError(f"{proc.name} not ready on port {port} after {_READY_TIMEOUT_S:g} s "
                         f"({last}): {_tail(proc.log)}")

    # measuring -------------------------------------------------------------------------------

    def wrk(self, url: str, body: bytes, run_prefix: str | None, seconds: float) -> dict[str, Any]:
        script = self.dir / "wrk.lua"
        script.write_text(wrk_script(body))
        argv = [self.options.wrk, "-t1", f"-c{self.options.concurrency}",
                f"-d{max(1, math.ceil(seconds)) + (0 if seconds == int(seconds) else 1)}s",
                "--timeout", "10s", "-s", str(script), url, "--", run_prefix or ""]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=self.dir)
        try:
            if seconds != int(seconds) or seconds < 1:
                # wrk takes whole seconds; SIGINT stops it early, and it reports the real runtime
                try:
                    popen.wait(seconds)
                except subprocess.TimeoutExpired:
                    popen.send_signal(signal.SIGINT)
            out, _ = popen.communicate(timeout=seconds + 30)
        finally:
            if popen.poll() is None:
                popen.kill()
                popen.communicate()
        text = out.decode(errors="replace")
        return parse_wrk(text)

    def latency(self, url: str, body: bytes, run_prefix: str | None) -> dict[str, Any]:
        body_file = self.dir / "loadgen-body.json"
        body_file.write_bytes(body)
        o = self.options
        argv = [sys.executable, "-m", "stepguard.bench.proxy", "--loadgen", "--url", url,
                "--rate", f"{o.rate:g}", "--duration", f"{o.rate_duration_s:g}", "--body-file",
                str(body_file), "--warmup", f"{min(WARMUP_S, o.rate_duration_s):g}"]
        if run_prefix:
            argv += ["--run-prefix", run_prefix]
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, cwd=self.dir,
                              timeout=o.rate_duration_s + WARMUP_S + 90, check=False)
        if done.returncode != 0:
            raise BenchError(f"the load generator failed ({done.returncode}): "
                             f"{done.stderr.decode(errors='replace')[-600:]}")
        result: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
        return result


def _readline(stream: Any, timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    line: bytes = stream.readline() if ready else b""
    return line


def nginx_conf(root: Path, port: int, upstream_port: int) -> str:
    temp = {name: root / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return f"""# generated by stepguard bench proxy
daemon off;
master_process on;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;    # never close a client's connection mid-phase
    client_body_temp_path {temp['client_body']};
    proxy_temp_path {temp['proxy']};
    fastcgi_temp_path {temp['fastcgi']};
    uwsgi_temp_path {temp['uwsgi']};
    scgi_temp_path {temp['scgi']};
    upstream bench_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location {MOUNT}/ {{
            proxy_pass http://bench_upstream/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


def wrk_script(body: bytes) -> str:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("request body cannot be embedded in the wrk script")
    return f"""-- generated by stepguard bench proxy: POST the body, one run id per request
wrk.method = "POST"
wrk.body = [==[{text}]==]
wrk.headers["Content-Type"] = "application/json"
local prefix = ""
local counter = 0
function init(args)
  prefix = args[1] or ""
end
function request()
  counter = counter + 1
  if prefix ~= "" then
    wrk.headers["{RUN_HEADER}"] = prefix .. "-" .. counter
  end
  return wrk.format()
end
"""


def parse_wrk(text: str) -> dict[str, Any]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    if not rps or not total:
        raise BenchError(f"wrk printed no result: {text.strip()[-600:]}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {"rps": float(rps.group(1)), "requests": int(total.group(1)),
            "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
            "socket_errors": sum(int(g) for g in sock.groups()) if sock else 0}


def count_events(store: Path) -> int | None:
    with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(store)) as conn:
        count: int = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        return count
    return None
