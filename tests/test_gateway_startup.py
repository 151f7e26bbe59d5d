"""The gateway's start as a new user meets it (no vLLM): what cannot work fails at once, in one
line, before an engine is started; an engine that never comes up is reported in one line that
names its own error; a body not sent as JSON is refused as vLLM refuses it.

Found by a new-user probe of ``scripts/serve.py`` (2026-12-04): with its port in use the
gateway started vLLM, waited a minute for it, logged "gateway ready", then failed to bind; a
``serve.model`` folder that is not there, or a mistyped vLLM flag, ended in a 30-line traceback
that said only "exited with code 2 (see <log>)"."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
    import json

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
    import httpx

    from batchpilot.serving.gateway import AppSettings, Gateway, build_app
    from batchpilot.serving.settings import ServeConfig
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
