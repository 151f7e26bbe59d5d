"""The gateway as an attacker or a careless client meets it (issue 12), against a real
``vllm serve``: no client gets another's answer, one huge or slow request freezes nothing,
core priority needs a trusted key, every malformed call is a JSON 4xx with a reason and leaves
the gateway as it was, every status is counted, and no engine outlives the gateway."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import AUTH, TRUSTED, RunningGateway, running_gateway

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]

SHIPPED = Path(__file__).resolve().parents[1] / "policies" / "pretrained"


@pytest.fixture(scope="module")
def gw() -> RunningGateway:
    with running_gateway("serve.header_timeout_s=2", "serve.body_timeout_s=3", "serve.control.interval_s=0.5",
                         f"serve.control.policy_dir={SHIPPED}") as g:
        yield g


def _addr(gw: RunningGateway) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


def _read_response(sock: socket.socket, timeout_s: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One final HTTP/1.1 response (Content-Length framed) from ``sock``, skipping 1xx ones."""
    sock.settimeout(timeout_s)
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"closed before a response head: {buf!r}")
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if 100 <= status < 200:
            continue
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(buf) < n:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
        return status, headers, buf[:n]


def _status_count(gw: RunningGateway, status: str) -> float:
    return gw.metric("batchpilot:requests_total", status=status)


def test_expect_100_continue_never_hands_one_clients_answer_to_another(gw: RunningGateway) -> None:
    """curl's way for bodies over 1 MB: headers with ``Expect: 100-continue``, wait for the
    interim answer, then the body. Each client must get its own completion (``echo``: the
    answer repeats the prompt), over the same pooled upstream connection."""
    host, port = _addr(gw)
    for i in range(3):
        alice = json.dumps({"prompt": f"alice secret {i}", "max_tokens": 2, "echo": True}).encode()
        with socket.create_connection((host, port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                      b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(alice))
            s.settimeout(60)
            assert s.recv(4096).startswith(b"HTTP/1.1 100")  # the gateway's own interim answer
            s.sendall(alice)
            status, _, body = _read_response(s)
        assert status == 200, body
        assert f"alice secret {i}" in json.loads(body)["choices"][0]["text"]
        bob = httpx.post(f"{gw.url}/v1/completions", json={"prompt": f"bob {i}", "max_tokens": 2, "echo": True},
                         timeout=60)
        assert bob.status_code == 200, bob.text
        text = bob.json()["choices"][0]["text"]
        assert f"bob {i}" in text and "alice" not in text
    assert _status_count(gw, "100") == 0


def test_a_huge_body_is_refused_and_freezes_nothing(gw: RunningGateway) -> None:
    host, port = _addr(gw)
    # Declared 50 MB: refused before a byte of it is read.
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                  b"content-length: 52428800\r\n\r\n")
        status, _, body = _read_response(s)
    assert status == 413 and json.loads(body)["error"]["reason"] == "body_too_large"
    # Chunked, undeclared, over the 8 MB cap: refused once the cap is passed.
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 20)

        def send() -> None:
            with contextlib.suppress(OSError):
                for _ in range(9):
                    s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                s.sendall(b"0\r\n\r\n")

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        status, _, body = _read_response(s)
    assert status == 413 and json.loads(body)["error"]["reason"] == "body_too_large"
    # A prompt of 4 MB (under the cap, far over the model's 2,048 tokens): refused without
    # tokenizing it, while the gateway keeps answering others at once.
    big = json.dumps({"prompt": "word " * 800_000, "max_tokens": 2}).encode()
    result: dict[str, httpx.Response] = {}

    def post_big() -> None:
        result["big"] = httpx.post(f"{gw.url}/v1/completions", content=big,
                                   headers={"content-type": "application/json"}, timeout=120)

    t = threading.Thread(target=post_big)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{gw.url}/healthz", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    assert result["big"].status_code == 400 and result["big"].json()["error"]["reason"] == "prompt_too_long"
    assert worst < 1.0, f"the gateway stalled {worst:.2f} s while refusing a 4 MB prompt"
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "still here", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_slow_heads_and_bodies_are_cut_off(gw: RunningGateway) -> None:
    """Connections that never finish their request head are closed (header_timeout_s=2); a
    body that stops arriving gets 408 (body_timeout_s=3)."""
    host, port = _addr(gw)
    socks = []
    for _ in range(50):
        s = socket.create_connection((host, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nx-slow: ")
        socks.append(s)
    deadline = time.monotonic() + 120
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        still = []
        for s in open_:
            s.settimeout(0.05)
            try:
                if s.recv(1024) == b"":
                    continue  # closed by the gateway
            except TimeoutError:
                still.append(s)
                continue
            except ConnectionResetError:
                continue
        open_ = still
    for s in socks:
        s.close()
    assert not open_, f"{len(open_)} half-open connections still held"
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"prompt\":")
        status, _, body = _read_response(s)
    assert status == 408 and json.loads(body)["error"]["reason"] == "body_timeout"


def test_core_priority_needs_a_trusted_key(gw: RunningGateway) -> None:
    body = {"prompt": "who am i", "max_tokens": 2}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-priority": "0"}, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["reason"] == "priority_not_allowed", r.text
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-priority": "0", "x-batchpilot-key": "guess"},
                   timeout=60)
    assert r.status_code == 403
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-priority": "0", **TRUSTED}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"x-priority": "5"}, timeout=60)
    assert r.status_code == 200, r.text  # anyone may make their own request less important


def test_deeply_nested_json_is_a_400(gw: RunningGateway) -> None:
    raw = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    r = httpx.post(f"{gw.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["reason"] == "invalid_json", r.text


@pytest.mark.parametrize("route, raw", [
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": \xff}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": Infinity}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": 1e999}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": -5}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": 100000}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"batch_cap": "8"}}'),
    ("/admin/freeze", b'{"frozen": true, "knobs": {"bucketing": "random"}}'),
    ("/admin/freeze", b'{"frozen": "yes"}'),
    ("/admin/freeze", b'{"frozen": true, "knobz": {}}'),
    ("/admin/policy/reload", b'{"path": 42}'),
    ("/admin/policy/reload", b'{"path": ["a", "b"]}'),
    ("/admin/policy/reload", b'{"path": "/x\\n2026-01-01 WARNING forged line"}'),
    ("/admin/policy/reload", b'{"canary_share": NaN}'),
    ("/admin/policy/reload", b'{"canary_share": 2}'),
    ("/admin/mode", b'{"mode": 7}'),
    ("/admin/mode", b'[' * 5000 + b']' * 5000),
    ("/admin/kv_dtype", b'{"dtype": {"a": 1}}'),
    ("/admin/kv_dtype", b'{"dtype": "fp8\\n"}'),
])
def test_malformed_admin_calls_are_400s_that_change_nothing(gw: RunningGateway, route: str, raw: bytes) -> None:
    # The static controller holds the knobs, so any change would be the call's doing; the
    # knobs are not frozen, so a refused freeze that froze anyway would show.
    r = httpx.post(f"{gw.url}/admin/mode", json={"mode": "static"}, headers=AUTH, timeout=30)
    assert r.status_code == 200
    time.sleep(1.0)  # a control tick under the static controller
    before = gw.status()["control"]
    assert before["frozen"] is False
    r = httpx.post(f"{gw.url}{route}", content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["reason"] in ("invalid_json", "invalid_body", "invalid_field") and err["message"]
    after = gw.status()["control"]
    for key in ("frozen", "mode", "acting", "policy_path", "fallback_reason"):
        assert after[key] == before[key], key
    assert [ln["knobs_in_force"] for ln in after["lanes"].values()] == \
        [ln["knobs_in_force"] for ln in before["lanes"].values()]
    with open(gw.log_path) as f:
        assert "\n2026-01-01 WARNING forged" not in f.read()


def test_a_policy_that_fails_to_load_keeps_the_running_one(gw: RunningGateway) -> None:
    post = lambda route, body: httpx.post(f"{gw.url}{route}", json=body, headers=AUTH, timeout=30)  # noqa: E731
    try:
        assert post("/admin/policy/reload", {"path": str(SHIPPED), "canary_share": 0}).status_code == 200
        assert post("/admin/mode", {"mode": "policy"}).json()["acting"] == "policy"
        r = post("/admin/policy/reload", {"path": "/no/such/policy", "canary_share": 0})
        assert r.status_code == 400 and r.json()["error"]["reason"] == "policy_load_failed", r.text
        st = gw.status()["control"]
        assert st["acting"] == "policy" and st["policy_path"] == str(SHIPPED) and st["fallback_reason"] is None, st
    finally:
        post("/admin/mode", {"mode": "pid"})


def test_every_status_is_counted_and_none_is_a_500(gw: RunningGateway) -> None:
    before = {s: _status_count(gw, s) for s in ("400", "401", "413", "404")}
    httpx.post(f"{gw.url}/v1/completions", content=b"{", timeout=30)
    httpx.get(f"{gw.url}/admin/status", timeout=30)
    httpx.post(f"{gw.url}/v1/completions", content=b"x" * (9 << 20), timeout=60)
    httpx.get(f"{gw.url}/no/such/route/{os.urandom(4).hex()}", timeout=30)
    for s in before:
        assert _status_count(gw, s) == before[s] + 1, s
    assert gw.metric("batchpilot:requests_total", route="other", status="404") >= 1
    assert _status_count(gw, "500") == 0
    with open(gw.log_path) as f:
        log = f.read()
    assert "unexpected error" not in log and "Exception in ASGI application" not in log


def test_the_admin_token_is_not_in_the_config_or_command_line() -> None:
    from batchpilot.config import load_config
    from batchpilot.serving.gateway import AppSettings

    with pytest.raises(ValueError, match="BATCHPILOT_ADMIN_TOKEN"):
        AppSettings.from_cfg(load_config(["serve.managed=true", "+serve.admin_token=secret"], config_name="serve_app"))


def _engine_pids(port: int) -> list[int]:
    """Processes whose command line names ``--port port`` (the managed vllm serve)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in cmd and cmd[cmd.index(b"--port") + 1] == str(port).encode():
                out.append(int(pid))
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _wait_gone(pgid: int, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.25)
    return False


def test_sigkill_of_the_gateway_leaves_no_engine() -> None:
    with running_gateway() as g:
        [pgid] = g.upstream_pids()
        assert _wait_gone(pgid, 0.5) is False  # the engine runs
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait(30)
        assert _wait_gone(pgid), "vllm serve outlived the gateway's SIGKILL"


def test_sigterm_during_a_restart_leaves_no_engine() -> None:
    with running_gateway("serve.health_interval_s=0.25") as g:
        [pgid] = g.upstream_pids()
        port = int(g.status()["upstreams"]["vllm0"]["url"].rsplit(":", 1)[1])
        os.killpg(pgid, signal.SIGKILL)  # a crash: the gateway restarts it
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [p for p in _engine_pids(port) if _pgid(p) not in (pgid, None)]:
            time.sleep(0.1)
        assert _engine_pids(port), "no restart began"
        g.proc.send_signal(signal.SIGTERM)  # while the new engine is still starting
        g.proc.wait(60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _engine_pids(port):
            time.sleep(0.25)
        assert not _engine_pids(port), "a vllm serve started by a restart outlived the gateway"
