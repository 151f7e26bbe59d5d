"""Running a real gateway (``scripts/serve.py``, managed ``vllm serve`` on the tiny model) for
the gateway tests, and a small async load generator. Every process started here is ended in
``finally`` (the gateway, and its vLLM process group in case the gateway could not)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from batchpilot.config import REPO_ROOT
from batchpilot.serving.upstream import free_port

TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TRUSTED_KEY = "trusted-test-key"
TRUSTED = {"x-batchpilot-key": TRUSTED_KEY}


@dataclass
class RunningGateway:
    url: str
    proc: subprocess.Popen
    log_path: str

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/admin/status", headers=AUTH, timeout=10).json()

    def upstream_pids(self) -> list[int]:
        return [u["pid"] for u in self.status()["upstreams"].values() if u["pid"]]

    def wait_ticks(self, n: int = 2, timeout_s: float = 60.0) -> None:
        """Until ``n`` more control ticks have started, so at least ``n - 1`` whole ticks ran
        after the call (counted, not slept: a busy machine delays ticks)."""
        start = self.status()["control"]["ticks"]
        wait_until(lambda: self.status()["control"]["ticks"] >= start + n, timeout_s, f"{n} more control ticks")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a gateway metric's samples matching ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout_s``. A test waits on a
    condition with a generous deadline, never on how fast this machine is."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached after {timeout_s:g} s: {what}"
        time.sleep(poll_s)


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"gateway exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/readyz not 200 after {timeout_s} s")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not ended within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def running_gateway(*overrides: str, timeout_s: float = 420.0, env: dict[str, str] | None = None,
                    request: pytest.FixtureRequest | None = None) -> Iterator[RunningGateway]:
    """``scripts/serve.py serve.managed=true`` on a free port, plus ``overrides`` (and ``env``
    added to its environment). ``timeout_s`` (for /readyz) is longer than the gateway's own
    ``serve.startup_timeout_s`` (300 s): on a slow machine the gateway, not the test, decides
    that vLLM did not start (and exits).

    The gateway's output (``gateway.log``) and its engines' logs (``engines/``, the gateway's
    default in its Hydra run folder) are in one temporary folder per gateway, removed when the
    test passes, kept otherwise and named in the failure (``/tmp/batchpilot-gateway-<port>.log``
    files used to be left behind by the dozen per CI run). A fixture shared by several tests
    passes its ``request``: a test that failed while the gateway ran keeps the folder too, named
    in a warning at the end of the run."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix=f"batchpilot-test-gateway-{port}-"))
    log_path = str(folder / "gateway.log")
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "serve.managed=true", f"serve.port={port}",
           "serve.kv_cache_space_gib=1", f"hydra.run.dir={folder}", "hydra.output_subdir=null",
           "hydra/job_logging=none", "hydra/hydra_logging=none", *overrides]
    proc_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", BATCHPILOT_ADMIN_TOKEN=TOKEN,
                    BATCHPILOT_TRUSTED_KEYS=TRUSTED_KEY, **(env or {}))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=proc_env, cwd=REPO_ROOT)
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path)
    pids: list[int] = []
    body_ok = False
    failed_before = request.session.testsfailed if request is not None else 0
    try:
        wait_ready(gw.url, timeout_s, proc)
        pids = gw.upstream_pids()
        yield gw
        body_ok = True
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            exc.add_note(f"the gateway's log and its engines' are kept in {folder}")
        raise
    finally:
        with contextlib.suppress(Exception):
            pids = gw.upstream_pids() or pids
        stop_process(proc)
        for pid in pids:  # the vLLM process group, if the gateway did not stop it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    # The gateway never answers 500: a bug still answers JSON, but its traceback is logged.
    if body_ok:
        with open(log_path, errors="replace") as f:
            text = f.read()
        for marker in ("unexpected error on", "Exception in ASGI application"):
            assert marker not in text, f"the gateway failed internally ({marker!r}); see {log_path} (kept)"
        if request is not None and request.session.testsfailed > failed_before:
            warnings.warn(f"a test failed while the gateway of {request.node.name} ran: its log and its "
                          f"engines' are kept in {folder}", stacklevel=1)
        else:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Outcome:
    status: int
    reason: str | None
    retry_after: str | None
    t_start: float
    t_end: float
    body: Any = None
    #: Streams: when the first chunk arrived (None: none did, or not a stream).
    t_first: float | None = None


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: int) -> int:
        return sum(o.status == status for o in self.outcomes)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], *, stream: bool = False,
                      headers: dict[str, str] | None = None, timeout_s: float = 120.0,
                      on_first_chunk: Callable[[], None] | None = None) -> Outcome:
    """One completion; ``on_first_chunk`` is called when a stream's first chunk arrives."""
    t0 = time.monotonic()
    t_first = None
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        if stream:
            async with client.stream("POST", url + path, json={**body, "stream": True}, headers=headers,
                                     timeout=timeout_s) as r:
                chunks = []
                async for chunk in r.aiter_bytes():
                    if t_first is None:
                        t_first = time.monotonic()
                        if on_first_chunk is not None:
                            on_first_chunk()
                    chunks.append(chunk)
                status, text = r.status_code, b"".join(chunks).decode(errors="replace")
                ra = r.headers.get("retry-after")
        else:
            r = await client.post(url + path, json=body, headers=headers, timeout=timeout_s)
            status, text, ra = r.status_code, r.text, r.headers.get("retry-after")
    except httpx.TimeoutException:
        return Outcome(-1, "client_timeout", None, t0, time.monotonic())
    except httpx.HTTPError as exc:
        return Outcome(-2, repr(exc), None, t0, time.monotonic())
    reason = None
    if status != 200:
        try:
            reason = httpx.Response(200, content=text).json()["error"].get("reason")
        except Exception:
            reason = None
    return Outcome(status, reason, ra, t0, time.monotonic(), text, t_first)


async def burst(url: str, n: int, rate: float, body: dict[str, Any], *, stream_every: int = 0,
                timeout_s: float = 120.0) -> LoadResult:
    """``n`` requests at ``rate`` per second (open loop), all awaited."""
    res = LoadResult()
    # A bounded client fleet: more connections than this wait in the client's pool.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = []
        t0 = time.monotonic()
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            stream = bool(stream_every) and i % stream_every == 0
            tasks.append(asyncio.create_task(one_request(client, url, body, stream=stream, timeout_s=timeout_s)))
        res.outcomes = list(await asyncio.gather(*tasks))
    return res


class FakeVLLM(BaseHTTPRequestHandler):
    """Just enough of vLLM's API for the gateway to start in front of it."""

    protocol_version = "HTTP/1.1"

    def _answer(self, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/v1/models"):
            self._answer(json.dumps({"data": [{"id": "fake", "max_model_len": 2048}]}).encode())
        elif self.path.startswith("/metrics"):
            self._answer(b"", "text/plain")
        else:
            self._answer(b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(b'{"count": 1}')

    def log_message(self, *args: Any) -> None:
        pass
