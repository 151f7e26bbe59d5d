"""The gateway's start and stop as a new user meets them (no vLLM): what cannot work fails at
once, in one line, before an engine is started; an engine that never comes up is reported in
one line that names its own error; a body not sent as JSON is refused as vLLM refuses it; a
stop lets requests in flight finish for a grace period and ends the rest cleanly.

Found by a new-user probe of ``scripts/serve.py`` (2026-12-04): with its port in use the
gateway started vLLM, waited a minute for it, logged "gateway ready", then failed to bind; a
``serve.model`` folder that is not there, or a mistyped vLLM flag, ended in a 30-line traceback
that said only "exited with code 2 (see <log>)"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from gateway_helpers import FakeVLLM

from batchpilot.config import REPO_ROOT
from batchpilot.serving.request_body import inspect_body
from batchpilot.serving.upstream import ManagedVLLM, Upstream, UpstreamDown, free_port, last_error_line


def _serve(tmp_path: Path, *overrides: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``scripts/serve.py`` with ``overrides``, run to its end (each case here ends by itself)."""
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), f"hydra.run.dir={tmp_path}",
           "hydra.output_subdir=null", *overrides]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_a_port_in_use_fails_at_once_in_one_line_before_any_engine_starts(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _serve(tmp_path, "serve.managed=true", f"serve.port={port}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (f"serve: error: cannot listen on 127.0.0.1:{port} (serve.host, serve.port): "
                                   "Address already in use"), done.stderr[-3000:]
    assert "started vllm serve" not in done.stdout + done.stderr


def test_a_host_that_does_not_resolve_fails_at_once(tmp_path: Path) -> None:
    done = _serve(tmp_path, "serve.managed=true", "serve.host=no-such-host.invalid", f"serve.port={free_port()}")
    assert done.returncode == 2 and done.stderr.startswith("serve: error: cannot listen on no-such-host.invalid:")
    assert len(done.stderr.strip().splitlines()) == 1 and "started vllm serve" not in done.stdout + done.stderr


def test_a_model_folder_that_is_not_there_is_refused_before_vllm_starts(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    done = _serve(tmp_path, "serve.managed=true", f"serve.model={missing}", f"serve.port={free_port()}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (f"serve: error: serve.model={str(missing)!r}: no such folder (a model folder with "
                                   "config.json; null = the built-in tiny model)")


def test_an_upstream_that_never_comes_up_ends_the_gateway_in_one_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = _serve(tmp_path, f"serve.upstreams=[{dead}]", "serve.startup_timeout_s=1", f"serve.port={free_port()}")
    out = done.stdout + done.stderr
    assert done.returncode == 3, out[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"serve: error: upstream vllm0 at {dead} not healthy after 1 s (last probe: connection refused "
        "(All connection attempts failed))"), out[-3000:]
    assert f"waiting up to 1 s for upstream vllm0 at {dead}: connection refused" in out  # said while it waited
    # No traceback: not the lifespan's, nor one from the body workers' pool at exit.
    assert "Traceback" not in out and "Exception ignored" not in out and "startup failed" not in out, out[-3000:]


def test_managed_engines_log_into_the_runs_folder(tmp_path: Path) -> None:
    """``scripts/serve.py serve.managed=true`` with no ``serve.log_dir``: the engine's log is
    ``engines/vllm-<port>.log`` in the Hydra run's folder (private), and nothing is made in the
    temporary folder (the old default, a fresh ``mkdtemp`` folder per start, piled up there).
    Stopped as soon as the engine is launched: no vLLM start-up is waited for."""
    import re
    import stat

    run, tmp, model = tmp_path / "run", tmp_path / "tmp", tmp_path / "model"
    tmp.mkdir()
    model.mkdir()  # a folder, so the gateway launches its engine; it is stopped before vLLM reads it
    out = tmp_path / "gateway.out"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "serve.managed=true", f"serve.model={model}",
           "serve.tokenizer=chars", f"serve.port={free_port()}", f"hydra.run.dir={run}"]
    with out.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        _wait_for(lambda: "started vllm serve pid=" in out.read_text() or proc.poll() is not None, 120,
                  "the gateway launching its engine")
        text = out.read_text()
        assert proc.poll() is None, text[-3000:]
        started = re.search(r"started vllm serve pid=(\d+) on http://127.0.0.1:(\d+)", text)
        assert started is not None, text[-3000:]
        pid, port = int(started[1]), started[2]
        engines = run / "engines"
        assert (engines / f"vllm-{port}.log").is_file(), sorted(p.name for p in run.rglob("*"))
        assert stat.S_IMODE(engines.stat().st_mode) == 0o700
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        _wait_for(lambda: _group_gone(pid), 30, "the engine's process group gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("batchpilot")], sorted(os.listdir(tmp))
    assert "Traceback" not in out.read_text(), out.read_text()[-3000:]


def test_a_negative_drain_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _serve(tmp_path, "serve.upstreams=[http://127.0.0.1:9]", "serve.drain_s=-1", f"serve.port={free_port()}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == ("serve: error: serve.drain_s must be a number of seconds >= 0 (how long requests in "
                                   "flight get to finish at a stop; 0 = end them at once), got -1.0"), done.stderr[-3000:]
    from batchpilot.schemas.serve import ServeConfig

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="serve.drain_s must be a number of seconds >= 0"):
            ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"], "drain_s": bad})
    assert ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"], "drain_s": 0}).drain_s == 0


class _DyingEngine(ManagedVLLM):
    """A "vllm serve" that fails as vLLM does on a mistyped flag: usage, then one error line."""

    def command(self) -> list[str]:
        script = ("import sys; print('INFO 12-04 [api_server.py] starting'); "
                  "print('WARNING 12-04 [utils.py] this can cause OSError: [Errno 24] Too many open files'); "
                  "print('usage: vllm_launch.py [-h] [--model MODEL]'); "
                  "print('vllm_launch.py: error: unrecognized arguments: --bogus-flag'); sys.exit(2)")
        return [sys.executable, "-c", script]


@pytest.mark.anyio
async def test_an_engine_that_dies_at_start_up_is_reported_with_its_own_error(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    engine = _DyingEngine("unused", free_port(), served_model_name="x", max_model_len=64, max_num_seqs=4,
                          log_path=log)
    up = Upstream(engine.url, managed=engine, name="vllm0")
    try:
        with pytest.raises(UpstreamDown) as err:
            await up.start(timeout_s=60)
    finally:
        engine.close()
        await up.aclose()
    assert str(err.value) == ("vllm serve for vllm0 exited with code 2 during start-up: vllm_launch.py: error: "
                              f"unrecognized arguments: --bogus-flag (log: {log})")


def test_the_error_line_of_a_failed_engines_log(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) ERROR 12-04 [core.py] EngineCore failed to start.\n"
                   "Traceback (most recent call last):\n"
                   '  File "x.py", line 1, in <module>\n'
                   "ValueError: block_size must be a multiple of 32 on CPU\n"
                   "(APIServer pid=2) WARNING 12-04 [utils.py] retrying after OSError: [Errno 98] in use\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
                   "\n")
    assert last_error_line(log) == "ValueError: block_size must be a multiple of 32 on CPU"
    log.write_text("INFO starting\n" + "x" * 10 + "\n")
    assert last_error_line(log) is None
    assert last_error_line(tmp_path / "missing.log") is None
    log.write_text("OSError: " + "y" * 1000 + "\n")
    line = last_error_line(log, limit=100)
    assert line is not None and len(line) == 100 and line.endswith("...")


# --- bodies as vLLM reads them ----------------------------------------------------------------
def _body(**fields: Any) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


@pytest.mark.parametrize("fields, kept", [
    ({"max_tokens": True}, {"max_tokens": 1}),  # pydantic's lax mode: true is 1 (vLLM serves it)
    ({"max_tokens": "8.0"}, {"max_tokens": 8}),
    ({"n": True, "stream": 1.0}, {"n": 1, "stream": True}),
    ({"stream": 0.0}, {"stream": False}),
])
def test_lax_values_are_read_as_vllm_reads_them(fields: dict[str, Any], kept: dict[str, Any]) -> None:
    parsed = inspect_body(_body(**fields), False, 256, 2048)
    assert {k: parsed.body[k] for k in kept} == kept


@pytest.mark.parametrize("fields", [{"max_tokens": "8.5"}, {"max_tokens": False}, {"stream": 2.0}])
def test_values_vllm_refuses_are_refused(fields: dict[str, Any]) -> None:
    from batchpilot.serving.errors import BadRequest

    with pytest.raises(BadRequest):
        inspect_body(_body(**fields), False, 256, 2048)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json-seq"])
async def test_a_body_not_sent_as_json_is_refused_as_vllm_refuses_it(
        content_type: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM answers 400 "Unsupported Media Type" unless the media type is application/json; the
    gateway answers the same before the request takes a slot (the upstream is never called)."""
    from batchpilot.schemas.serve import ServeConfig
    from batchpilot.serving.gateway import AppSettings, Gateway, build_app
    from batchpilot.serving.upstream import EngineInfo

    settings = AppSettings(serve=ServeConfig.from_cfg({"upstreams": ["http://127.0.0.1:9"], "tokenizer": "chars"}))
    app = build_app(settings)
    gw = Gateway(settings)
    app.state.gateway = gw
    up = gw.lanes[0].upstream
    up.healthy, up.info = True, EngineInfo(model="tiny", max_model_len=2048)
    headers = {"content-type": content_type} if content_type else {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.post("/v1/completions", content=_body(max_tokens=2), headers=headers)
            ok = await c.post("/v1/completions", content=b"{", headers={"content-type": "Application/JSON; charset=utf-8"})
    finally:
        up.pool.close()
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["reason"] == "unsupported_media_type"
    assert err["message"] == "Unsupported Media Type: Only 'application/json' is allowed"
    assert gw.lanes[0].admission.num_in_flight == 0
    # The media type is compared as vLLM compares it (case and parameters aside): that body gets
    # as far as the JSON check.
    assert ok.status_code == 400 and ok.json()["error"]["reason"] == "invalid_json"


# --- a stop with requests in flight ------------------------------------------------------------
class _SlowVLLM(FakeVLLM):
    """Enough of vLLM for the gateway, answering a completion after ``max_tokens`` x 50 ms: a
    stream one event per 50 ms then ``[DONE]``, a plain answer all at once at the end."""

    step_s = 0.05

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        n = int(body.get("max_tokens") or 1)
        try:
            if not body.get("stream"):
                time.sleep(n * self.step_s)
                self._answer(json.dumps({"choices": [{"index": 0, "text": "x" * n}]}).encode())
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(n + 1):
                event = b"data: [DONE]\n\n" if i == n else b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(self.step_s)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the gateway closed the connection: the request is aborted
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@contextlib.contextmanager
def _gateway_before_slow_upstream(tmp_path: Path, *overrides: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """``scripts/serve.py`` (a subprocess, its log in ``tmp_path/gateway.log``) in front of an
    upstream that never tires (``_SlowVLLM``, no vLLM): yields the process, its URL and its log;
    kills what is left of it and stops the upstream afterwards."""
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _SlowVLLM)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    log = tmp_path / "gateway.log"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), f"hydra.run.dir={tmp_path}",
           "hydra.output_subdir=null", f"serve.upstreams=[http://127.0.0.1:{upstream.server_port}]",
           f"serve.port={port}", "serve.tokenizer=chars", "serve.startup_timeout_s=60", *overrides]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        upstream.shutdown()
        upstream.server_close()


async def _until_ready(c: httpx.AsyncClient, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if (await c.get("/readyz", timeout=2)).status_code == 200:
                return
        await asyncio.sleep(0.1)


def test_a_stop_lets_requests_finish_then_ends_the_rest_cleanly(tmp_path: Path) -> None:
    """SIGTERM with three requests in flight, in front of an upstream that never tires (no
    vLLM): a stream that ends within the grace ends whole; an endless stream ends with an SSE
    error event (``shutting_down``) and ``[DONE]``, its chunked body complete; an endless plain
    request gets 503 ``shutting_down``. The gateway exits with no traceback in its log (uvicorn
    used to cancel such requests after 5 s: cut bodies, one 50-line "Exception in ASGI
    application" each). The grace is ``serve.drain_s``, here 2 s (the default is 4): the
    endless requests are ended no sooner, and the log and their answers say so."""
    drain_s = 2.0
    short = int((drain_s / 4) / _SlowVLLM.step_s)  # ends a quarter of the grace in
    stopped_after: list[float] = []
    endless = 2000  # 100 s: past any grace (the most a request may ask for: max_model_len)

    async def scenario(proc: subprocess.Popen, url: str, log: Path) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            deadline = time.monotonic() + 120
            await _until_ready(c, proc, log, deadline)
            calls = [c.post("/v1/completions", json={"prompt": "a", "max_tokens": endless, "stream": True}),
                     c.post("/v1/completions", json={"prompt": "b", "max_tokens": endless}),
                     c.post("/v1/completions", json={"prompt": "c", "max_tokens": short, "stream": True})]
            tasks = [asyncio.ensure_future(call) for call in calls]
            while "batchpilot:in_flight" not in (text := (await c.get("/metrics")).text) or \
                    'in_flight{upstream="vllm0"} 3.0' not in text:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), text[-2000:]
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            t_stop = time.monotonic()
            answers = list(await asyncio.gather(*tasks))
            stopped_after.append(time.monotonic() - t_stop)
            return answers

    with _gateway_before_slow_upstream(tmp_path, f"serve.drain_s={drain_s}") as (proc, url, log):
        stream, plain, short_stream = asyncio.run(scenario(proc, url, log))
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn raises the SIGTERM again once stopped
    text = log.read_text()
    events = _events(stream.text)
    assert stream.status_code == 200 and events[-1] == "[DONE]", stream.text[-500:]
    assert json.loads(events[-2])["error"]["reason"] == "shutting_down", events[-2]
    assert plain.status_code == 503 and plain.json()["error"]["reason"] == "shutting_down", plain.text
    assert plain.headers.get("retry-after") is not None
    assert _events(short_stream.text) == ['{"choices": [{"index": 0, "text": "x"}]}'] * short + ["[DONE]"]
    assert f"request(s) in flight get up to {drain_s:g} s to finish (serve.drain_s)" in text, text[-3000:]
    assert f"ended 2 request(s) still in flight after {drain_s:g} s" in text, text[-3000:]
    assert f"ended after {drain_s:g} s of grace" in plain.json()["error"]["message"], plain.text
    assert stopped_after[0] >= drain_s, stopped_after  # the endless ones got the whole grace
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


def test_a_second_ctrl_c_ends_the_gateway_at_once_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C twice, the second while two endless requests keep the drain waiting (its grace,
    ``serve.drain_s``, is 60 s here): the gateway ends them and exits within seconds, says so in
    one log line, prints no traceback and leaves no process of its own behind. uvicorn took the
    second Ctrl-C as "force quit": the lifespan's stop (the engines) was skipped and each
    request still answering, then ``KeyboardInterrupt`` itself, printed a traceback."""
    import psutil

    children: list[psutil.Process] = []
    took: list[float] = []

    async def scenario(proc: subprocess.Popen, url: str, log: Path) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            deadline = time.monotonic() + 120
            await _until_ready(c, proc, log, deadline)
            children.extend(psutil.Process(proc.pid).children(recursive=True))  # the body worker
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2000,
                                                                           "stream": True})),
                     asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2000}))]
            while 'in_flight{upstream="vllm0"} 2.0' not in (text := (await c.get("/metrics")).text):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), text[-2000:]
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            while "get up to 60 s to finish" not in log.read_text():  # draining: the grace has begun
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), log.read_text()[-3000:]
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            t_second = time.monotonic()
            answers = list(await asyncio.gather(*tasks))
            took.append(time.monotonic() - t_second)
            return answers

    with _gateway_before_slow_upstream(tmp_path, "serve.drain_s=60", "serve.body_workers=1") as (proc, url, log):
        stream, plain = asyncio.run(scenario(proc, url, log))
        code = proc.wait(timeout=30)  # far less than the 60 s grace
    text = log.read_text()
    assert code == 0, text[-3000:]  # Ctrl-C is the gateway's normal end (as uvicorn's own command)
    assert took[0] < 20, took  # not the 60 s grace
    assert "Traceback" not in text and "Exception" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.count("second stop signal: ending the requests in flight and the engines now") == 1, text[-3000:]
    assert "ended 2 request(s) still in flight after" in text and "at a second stop signal" in text, text[-3000:]
    assert "Application shutdown complete" in text, text[-3000:]  # the lifespan's stop ran (engines, workers)
    events = _events(stream.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["reason"] == "shutting_down", events[-3:]
    assert "at the gateway's second stop signal" in json.loads(events[-2])["error"]["message"], events[-2]
    assert plain.status_code == 503 and plain.json()["error"]["reason"] == "shutting_down", plain.text
    assert children, "the gateway's body worker was not found"
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.pid for p in alive]


class _SlowToStop(ManagedVLLM):
    """A "vllm serve" that ignores SIGTERM (a vLLM slow to shut down): only SIGKILL ends it."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(120)"]


def test_a_second_ctrl_c_kills_the_engines_being_stopped(tmp_path: Path) -> None:
    """The gateway's stop gives each engine 10 s of vLLM's own shutdown before SIGKILL; after a
    second Ctrl-C (``Gateway.hurry``) a stop under way kills the group at once, and a stop yet
    to come does not wait at all. A running engine that is not being stopped is left alone."""
    from batchpilot.schemas.serve import ServeConfig
    from batchpilot.serving.gateway import AppSettings, Gateway
    from batchpilot.serving.upstream import ManagedVLLM as Real

    gw = Gateway(AppSettings(serve=ServeConfig.from_cfg({"managed": True, "num_managed": 2, "model": str(tmp_path),
                                                         "tokenizer": "chars", "log_dir": str(tmp_path / "logs")})))
    engines = [ln.upstream.managed for ln in gw.lanes]
    assert all(isinstance(e, Real) for e in engines)
    for e in engines:
        e.__class__ = _SlowToStop  # the same engine, started as the fake
    try:
        for e in engines:
            e.start()
        for e in engines:
            assert e.log_path is not None
            _wait_for(lambda e=e: "up" in e.log_path.read_text(), 30, f"{e.url} started")
        groups = [e.pid for e in engines]
        closing = threading.Thread(target=engines[0].close)
        closing.start()
        closing.join(1.0)
        assert closing.is_alive()  # waiting out vLLM's shutdown grace (10 s)
        gw.hurry()
        closing.join(5.0)
        assert not closing.is_alive(), "the stop under way was not cut short"
        assert engines[1].alive()  # not being stopped: left alone
        t0 = time.monotonic()
        engines[1].close()  # a stop after the hurry: no grace
        assert time.monotonic() - t0 < 5.0
        for pgid in groups:  # the killed engine's child is reaped by init a moment later
            _wait_for(lambda pgid=pgid: _group_gone(pgid), 10, f"process group {pgid} gone")
    finally:
        for e in engines:
            e.kill()
            e.close()
        for ln in gw.lanes:
            ln.upstream.pool.close()


class _MakesSockets(ManagedVLLM):
    """A "vllm serve" that makes a socket file where vLLM makes its own (VLLM_RPC_BASE_PATH)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import os, socket, time, uuid; s = socket.socket(socket.AF_UNIX); "
                "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], str(uuid.uuid4()))); "
                "print('up', flush=True); time.sleep(120)"]


def test_a_stopped_engine_leaves_no_socket_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launch of a managed engine gets its own folder for vLLM's socket files, removed when
    the engine stops (vLLM leaves them: thousands piled up in /tmp); a restart gets a new one.
    A VLLM_RPC_BASE_PATH the user exported is used as it is and never removed."""
    # A short temporary folder of this test's: a socket's path must fit in 107 bytes (tmp_path's do not).
    tmp = Path(tempfile.mkdtemp(prefix="bp-ipc-test-"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    e = _MakesSockets("m", free_port(), served_model_name="m", max_model_len=64, max_num_seqs=4,
                      log_path=tmp_path / "vllm.log")
    try:
        seen = []
        for _ in range(2):  # a start, then a restart
            e.start()
            _wait_for(lambda: "up" in (tmp_path / "vllm.log").read_text(), 30, "the fake engine started")
            assert e.ipc_dir is not None and e.ipc_dir.parent == tmp and e.ipc_dir not in seen
            _wait_for(lambda: any(p.is_socket() for p in e.ipc_dir.iterdir()), 30, "its socket made")
            seen.append(e.ipc_dir)
            e.stop(grace_s=5.0)
            (tmp_path / "vllm.log").unlink()
        assert list(tmp.iterdir()) == [], "a socket or its folder outlived the engine"
        mine = tmp / "mine"
        mine.mkdir()
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
        e.start()
        _wait_for(lambda: any(p.is_socket() for p in mine.iterdir()), 30, "its socket made in the user's folder")
        assert e.ipc_dir is None
        e.close()
        assert mine.is_dir()
    finally:
        e.kill()
        e.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached after {timeout_s:g} s: {what}"
        time.sleep(0.05)


@pytest.mark.slow  # three gateway starts
def test_the_test_gateways_logs_are_removed_on_success_and_kept_on_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gateway_helpers.running_gateway`` (here unmanaged, in front of a fake vLLM) keeps the
    gateway's log in a temporary folder of its own: removed when the test passes, kept and named
    when it fails, or when a test sharing the gateway failed (a warning names it). It wrote
    ``/tmp/batchpilot-gateway-<port>.log`` and never removed it."""
    from types import SimpleNamespace

    from gateway_helpers import running_gateway

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    unmanaged = ("serve.managed=false", f"serve.upstreams=[http://127.0.0.1:{upstream.server_port}]",
                 "serve.tokenizer=chars", "serve.startup_timeout_s=60")
    try:
        with running_gateway(*unmanaged, timeout_s=120) as gw:
            folder = Path(gw.log_path).parent
            assert folder.parent == tmp and "gateway ready" in Path(gw.log_path).read_text()
        assert not folder.exists() and os.listdir(tmp) == []  # passed: nothing left

        with pytest.raises(AssertionError) as failed:
            with running_gateway(*unmanaged, timeout_s=120) as gw:
                folder = Path(gw.log_path).parent
                raise AssertionError("the test failed")
        assert f"the gateway's log and its engines' are kept in {folder}" in failed.value.__notes__
        assert Path(gw.log_path).is_file()

        shared = SimpleNamespace(session=SimpleNamespace(testsfailed=3), node=SimpleNamespace(name="gw"))
        with pytest.warns(UserWarning, match="a test failed while the gateway of gw ran: .* kept in "):
            with running_gateway(*unmanaged, timeout_s=120, request=shared) as gw:  # type: ignore[arg-type]
                shared.session.testsfailed += 1  # a test using the module's gateway failed
        assert Path(gw.log_path).is_file()
    finally:
        upstream.shutdown()
        upstream.server_close()


@pytest.mark.anyio
@pytest.mark.parametrize("chat, body", [
    (False, {"prompt": "a\ud800b"}),  # a lone surrogate: valid JSON (\\ud800), not UTF-8
    (True, {"messages": [{"role": "user", "content": "a\udfffb"}]}),
])
async def test_a_prompt_the_tokenizer_cannot_take_is_a_400_not_a_500(tiny_model_path: Path, chat: bool,
                                                                     body: dict[str, Any]) -> None:
    """vLLM answers such a prompt 400 (its tokenizer raises TypeError); the gateway's local
    tokenizer raised the same TypeError, which became a 500 ``internal_error``. Now a
    ``ValueError``, which the gateway answers 400 ``invalid_prompt``."""
    from batchpilot.serving.tokens import PromptCounter

    async def no_upstream(_: Any) -> int:
        raise AssertionError("the local tokenizer counts")

    counter = PromptCounter("auto", str(tiny_model_path))
    assert counter.mode == "local"
    with pytest.raises(ValueError, match="TextEncodeInput"):
        await counter.count(body, chat, no_upstream)
    # Content parts whose text is not a string are not counted (vLLM refuses them itself).
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": "hi"}]}]}
    assert await counter.count(parts, True, no_upstream) == await counter.count(
        {"messages": [{"role": "user", "content": "hi"}]}, True, no_upstream)
