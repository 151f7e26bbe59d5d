"""A soak of the gateway in front of a managed ``vllm serve`` (``scripts/soak.py``): mixed
traffic for a while, with a fault injected every few minutes, and the figures an operator asks
of a proxy: requests sent, answers by status, answers that reached the wrong client (must be 0),
and the p99 latency of normal requests during each fault.

Normal traffic: ``clients`` closed-loop clients sending small completions (a share streamed),
each prompt carrying a unique marker that the answer repeats (``echo``): an answer without its
own marker crossed clients. Faults, in turn: the engine's process group SIGSTOPped for
``sigstop_s`` then continued; the engine SIGKILLed (the gateway restarts it; the fault lasts
until /readyz is 200 again); huge bodies (a 7.5 MB /tokenize prompt, 2.7 million empty arrays
in an unknown completion field) sent for ``burst_s``; slow clients (heads and bodies trickled
a byte at a time) for ``burst_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from batchpilot.config import REPO_ROOT
from batchpilot.serving.upstream import free_port

FAULTS = ("sigstop", "sigkill", "huge_body", "slow_client")


@dataclass(slots=True)
class SoakConfig:
    """``conf/soak.yaml``."""

    #: Seconds of traffic in all.
    duration_s: float = 1800.0
    #: Seconds from the end of one fault to the start of the next.
    fault_every_s: float = 180.0
    #: The faults, injected in this order, again and again (``FAULTS``).
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    #: Faults injected at least (the run goes on past ``duration_s`` for them: a restart may take
    #: minutes on a slow machine); 0: as many as ``duration_s`` holds.
    min_faults: int = 0
    #: How long the engine stays stopped (sigstop); how long huge bodies / slow clients go on.
    sigstop_s: float = 20.0
    burst_s: float = 20.0
    #: Closed-loop clients of normal traffic, their pause between requests, and their requests.
    clients: int = 8
    think_s: float = 0.05
    max_tokens: int = 8
    stream_share: float = 0.3
    #: A normal request's client-side timeout (above the gateway's request_timeout_s: a client
    #: timeout means the gateway never answered).
    client_timeout_s: float = 90.0
    #: Overrides for ``scripts/serve.py`` (the gateway is started with serve.managed=true).
    gateway_overrides: list[str] = field(default_factory=list)
    startup_timeout_s: float = 420.0
    #: Where the gateway's and the engine's logs go (None: a new temporary folder, kept).
    log_dir: str | None = None

    def __post_init__(self) -> None:
        bad = [f for f in self.faults if f not in FAULTS]
        if bad:
            raise ValueError(f"soak.faults: unknown fault(s) {bad}; known: {list(FAULTS)}")
        for name in ("duration_s", "fault_every_s", "sigstop_s", "burst_s", "client_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"soak.{name} must be > 0, got {getattr(self, name)}")
        if self.min_faults < 0:
            raise ValueError(f"soak.min_faults must be >= 0, got {self.min_faults}")
        if self.clients < 1 or self.max_tokens < 1 or not 0 <= self.stream_share <= 1:
            raise ValueError("soak.clients and soak.max_tokens must be >= 1 and soak.stream_share in [0, 1]")


@dataclass(slots=True)
class Answer:
    """One normal request: when it started and ended, its status (-1: client timeout, -2: the
    connection failed) and whether its answer carried another request's marker or none."""

    t0: float
    t1: float
    status: int | str
    crossed: bool = False
    retry_after: bool = False
    #: A crossed answer's text (its start), for the report.
    detail: str = ""


@dataclass(slots=True)
class FaultWindow:
    kind: str
    t0: float
    t1: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Gateway:
    """``scripts/serve.py serve.managed=true`` on a free port, for the soak."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.folder = Path(cfg.log_dir or tempfile.mkdtemp(prefix=f"batchpilot-soak-{self.port}-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "serve.managed=true", f"serve.port={self.port}",
               f"hydra.run.dir={self.folder}", "hydra.output_subdir=null", "hydra/job_logging=none",
               "hydra/hydra_logging=none", *self.cfg.gateway_overrides]
        env = dict(os.environ, BATCHPILOT_ADMIN_TOKEN=self.token)
        with open(self.folder / "gateway.log", "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start; see {self.folder / 'gateway.log'}")
            time.sleep(0.5)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_pid(self) -> int:
        s = httpx.get(f"{self.url}/admin/status", headers={"authorization": f"Bearer {self.token}"}, timeout=30).json()
        return next(u["pid"] for u in s["upstreams"].values() if u["pid"])

    def stop(self) -> None:
        pids: list[int] = []
        with contextlib.suppress(Exception):
            pids = [self.engine_pid()]
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in pids:  # the engine's group, if the gateway could not stop it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGCONT)
                os.killpg(pid, signal.SIGKILL)


async def _normal_client(url: str, cfg: SoakConfig, who: int, answers: list[Answer], stop: asyncio.Event) -> None:
    """Closed loop: one request at a time, each with a marker its answer must repeat."""
    n = 0
    async with httpx.AsyncClient(timeout=cfg.client_timeout_s) as client:
        while not stop.is_set():
            n += 1
            marker = f"soak-{who}-{n}-{secrets.token_hex(4)}"
            stream = (n * 7919 + who) % 100 < cfg.stream_share * 100
            body = {"prompt": f"{marker} tell", "max_tokens": cfg.max_tokens, "echo": True, "stream": stream}
            t0 = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
                a = Answer(t0, time.monotonic(), r.status_code, retry_after="retry-after" in r.headers)
                if r.status_code == 200:
                    got = _answer_text(r.text, stream)
                    if got is None:  # a stream ended by an error event before any text (engine killed)
                        a.status = "200+error"
                    elif not got.startswith(f"{marker} tell"):  # the echoed prompt: this request's own
                        a.crossed, a.detail = True, f"sent {marker!r}, got {got[:120]!r}"
            except httpx.TimeoutException:
                a = Answer(t0, time.monotonic(), -1)
            except httpx.HTTPError:
                a = Answer(t0, time.monotonic(), -2)
            answers.append(a)
            await asyncio.sleep(cfg.think_s)


def _answer_text(text: str, stream: bool) -> str | None:
    """An answer's text (streamed: the chunks' texts joined), which must start with the
    echoed prompt, its marker included (what the random model generates after it may repeat
    bits of any prompt). None: a stream that ended with an error event (the gateway's, as vLLM
    ends a failed stream) before any text."""
    if not stream:
        return json.loads(text)["choices"][0]["text"]
    parts, error = [], False
    for line in text.splitlines():
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            error = error or "error" in ev
            if ev.get("choices"):
                parts.append(ev["choices"][0].get("text") or "")
    return None if error and not parts else "".join(parts)


async def _huge_bodies(url: str, until: float) -> dict[str, int]:
    """Huge bodies from three clients until ``until``: the answers by status."""
    tok = json.dumps({"prompt": "lorem ipsum " * 625_000}).encode()
    junk = b'{"prompt": "hi", "max_tokens": 2, "junk": [' + b",".join([b"[]"] * 2_700_000) + b"]}"
    seen: dict[str, int] = {}

    async def one(path: str, raw: bytes) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < until:
                try:
                    r = await client.post(url + path, content=raw, headers={"content-type": "application/json"})
                    key = str(r.status_code)
                except httpx.HTTPError:
                    key = "error"
                seen[key] = seen.get(key, 0) + 1

    await asyncio.gather(one("/tokenize", tok), one("/v1/completions", junk), one("/tokenize", tok))
    return seen


async def _slow_clients(port: int, until: float, n: int = 50) -> dict[str, int]:
    """``n`` connections trickling a request a byte at a time until ``until`` (or until the
    gateway closes them): how many were closed by the gateway."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{\"prompt\": ")

    async def one(i: int) -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return "refused"
        data = head if i % 2 else head[:30]  # half stall in the body, half in the head
        try:
            for b in data:
                if time.monotonic() > until:
                    return "held"
                writer.write(bytes([b]))
                await writer.drain()
                await asyncio.sleep(0.5)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(1), max(until - time.monotonic(), 0.01))
            return "closed" if reader.at_eof() else "held"
        except (ConnectionError, OSError):
            return "closed"
        finally:
            writer.close()

    out = await asyncio.gather(*(one(i) for i in range(n)))
    return {k: out.count(k) for k in set(out)}


async def _inject(gw: Gateway, cfg: SoakConfig, kind: str) -> FaultWindow:
    """One fault, from its start until it is over (for sigkill: the gateway ready again)."""
    w = FaultWindow(kind, time.monotonic())
    if kind in ("sigstop", "sigkill"):
        pid = await asyncio.to_thread(gw.engine_pid)
        os.killpg(pid, signal.SIGSTOP if kind == "sigstop" else signal.SIGKILL)
        if kind == "sigstop":
            await asyncio.sleep(cfg.sigstop_s)
            os.killpg(pid, signal.SIGCONT)
        else:
            await asyncio.sleep(1.0)
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not await asyncio.to_thread(gw.ready) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        w.extra["back_after_s"] = round(time.monotonic() - w.t0, 1)
    elif kind == "huge_body":
        w.extra["answers"] = await _huge_bodies(gw.url, w.t0 + cfg.burst_s)
    else:
        w.extra["connections"] = await _slow_clients(gw.port, w.t0 + cfg.burst_s)
    w.t1 = time.monotonic()
    return w


async def run_soak(cfg: SoakConfig, gw: Gateway) -> dict[str, Any]:
    """Traffic on a started gateway for ``cfg.duration_s`` with faults; the figures (``summarize``)."""
    answers: list[Answer] = []
    windows: list[FaultWindow] = []
    stop = asyncio.Event()
    t_start = time.monotonic()
    clients = [asyncio.create_task(_normal_client(gw.url, cfg, i, answers, stop)) for i in range(cfg.clients)]
    i = 0
    while True:
        next_at = (windows[-1].t1 if windows else t_start) + cfg.fault_every_s
        if next_at >= t_start + cfg.duration_s and i >= cfg.min_faults:
            break
        await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
        windows.append(await _inject(gw, cfg, cfg.faults[i % len(cfg.faults)]))
        i += 1
    # Past the last fault: calm traffic until the end, and at least fault_every_s of it.
    end = max(t_start + cfg.duration_s, (windows[-1].t1 + cfg.fault_every_s) if windows else 0.0)
    await asyncio.sleep(max(end - time.monotonic(), 0.0))
    stop.set()
    await asyncio.gather(*clients)
    return summarize(answers, windows, time.monotonic() - t_start)


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(0.99 * len(v)))], 3)


def summarize(answers: list[Answer], windows: list[FaultWindow], wall_s: float) -> dict[str, Any]:
    """Requests sent, answers by status, crossed answers, and per fault window the normal
    requests started in it: their count, statuses and p99 latency (all, and the 200s)."""
    by_status: dict[str, int] = {}
    for a in answers:
        by_status[str(a.status)] = by_status.get(str(a.status), 0) + 1
    faults = []
    for w in windows:
        inside = [a for a in answers if w.t0 <= a.t0 <= w.t1]
        st: dict[str, int] = {}
        for a in inside:
            st[str(a.status)] = st.get(str(a.status), 0) + 1
        faults.append({"kind": w.kind, "at_s": round(w.t0 - answers[0].t0, 1) if answers else 0.0,
                       "lasted_s": round(w.t1 - w.t0, 1), "requests": len(inside), "statuses": st,
                       "p99_s": _p99([a.t1 - a.t0 for a in inside]),
                       "p99_ok_s": _p99([a.t1 - a.t0 for a in inside if a.status == 200]), **w.extra})
    calm = [a for a in answers if not any(w.t0 <= a.t0 <= w.t1 for w in windows)]
    return {"wall_s": round(wall_s, 1), "sent": len(answers), "by_status": by_status,
            "crossed": sum(a.crossed for a in answers),
            "crossed_examples": [a.detail for a in answers if a.crossed][:5],
            "refusals_without_retry_after": sum(a.status in (429, 503) and not a.retry_after for a in answers),
            "p99_calm_s": _p99([a.t1 - a.t0 for a in calm if a.status == 200]), "faults": faults}


def soak(cfg: SoakConfig) -> dict[str, Any]:
    """Start the gateway, run the soak, stop it; the figures (the logs' folder in ``log_dir``)."""
    gw = Gateway(cfg)
    try:
        gw.start()
        out = asyncio.run(run_soak(cfg, gw))
    finally:
        gw.stop()
    out["log_dir"] = str(gw.folder)
    (gw.folder / "soak.json").write_text(json.dumps(out, indent=1))
    return out

