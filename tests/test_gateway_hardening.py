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
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import AUTH, TRUSTED, RunningGateway, running_gateway

from batchpilot.serving.reaper import IPC_DIR_PREFIX

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(900)]

SHIPPED = Path(__file__).resolve().parents[1] / "policies" / "pretrained"


@pytest.fixture(scope="module")
def gw(request: pytest.FixtureRequest) -> RunningGateway:
    # body_timeout_s: well above what the large (4-9 MB) bodies below take to arrive on a slow,
    # busy machine, since each must be refused for its content, not cut off as slow.
    # max_json_containers: above the millions of arrays/objects of the bodies below, so that
    # their parse off the loop is what is tested (the default refuses them before the parse:
    # tests/test_gateway_hardening2.py).
    with running_gateway("serve.header_timeout_s=2", "serve.body_timeout_s=10", "control.interval_s=0.5",
                         "serve.max_json_containers=4000000",
                         f"serve.control.policy_dir={SHIPPED}", request=request) as g:
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
    # tokenizing it; 1.6 million one-letter prompts (7.6 MiB): refused by the list's length,
    # before its items are looked at (the checks held the loop ~0.5 s); 600,000 chat messages:
    # the same; 2.7 million empty arrays (the parse's garbage collections held the loop for
    # seconds; in the gateway's thread the C parse held the loop 0.25-1.2 s: a worker process
    # parses it now). Normal completions sent meanwhile are answered within a second (the
    # issue's bound).
    _others_served_while(gw, json.dumps({"prompt": "word " * 800_000, "max_tokens": 2}).encode(), "prompt_too_long")
    _others_served_while(gw, json.dumps({"prompt": ["a"] * 1_600_000, "max_tokens": 2}).encode(),
                         "too_many_sequences")
    _others_served_while(gw, json.dumps({"messages": [{"role": "u"}] * 600_000}, separators=(",", ":")).encode(),
                         "prompt_too_long", path="/v1/chat/completions")
    # (A list of lists is a batch of token-id prompts, so it is refused by its length.)
    _others_served_while(gw, b'{"prompt": [' + b",".join([b"[]"] * 2_700_000) + b"]}", "too_many_sequences")


def _others_served_while(gw: RunningGateway, big: bytes, reason: str, bound_s: float = 1.0,
                         path: str = "/v1/completions") -> None:
    """Send ``big`` (refused with ``reason``) while another client sends normal completions back
    to back; repeat ``big`` until at least 3 completions overlapped one of its requests. Every
    completion is a 200 within ``bound_s``, or within 10 times the median of 5 completions sent
    alone just before, where this machine is that much slower."""
    with httpx.Client(timeout=60) as c:
        alone = []
        for _ in range(5):
            t0 = time.monotonic()
            assert c.post(f"{gw.url}/v1/completions", json={"prompt": "alone", "max_tokens": 2}).status_code == 200
            alone.append(time.monotonic() - t0)
    alone_s = statistics.median(alone)
    bound_s = max(bound_s, 10 * alone_s)
    stop = threading.Event()
    done: list[tuple[float, float, int]] = []  # start, end, status of each normal completion

    def normal() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                r = c.post(f"{gw.url}/v1/completions", json={"prompt": "meanwhile", "max_tokens": 2})
                done.append((t0, time.monotonic(), r.status_code))

    t = threading.Thread(target=normal, daemon=True)
    t.start()
    windows: list[tuple[float, float]] = []
    overlapped: list[tuple[float, float, int]] = []
    try:
        with httpx.Client(timeout=120) as c:
            while not done:  # the other client is under way
                time.sleep(0.01)
            for _ in range(20):
                t0 = time.monotonic()
                r = c.post(f"{gw.url}{path}", content=big, headers={"content-type": "application/json"})
                windows.append((t0, time.monotonic()))
                assert r.status_code == 400 and r.json()["error"]["reason"] == reason, r.text[:300]
                overlapped = [d for d in list(done) if any(d[0] < w1 and d[1] > w0 for w0, w1 in windows)]
                if len(overlapped) >= 3:
                    break
    finally:
        stop.set()
        t.join(120)
    assert len(overlapped) >= 3, f"too few completions overlapped the large requests: {len(overlapped)}"
    assert {d[2] for d in done} == {200}, done
    worst = max(d[1] - d[0] for d in overlapped)
    assert len(big) < 8 << 20  # under serve.max_body_bytes: read and parsed
    assert worst < bound_s, (f"a completion waited {worst:.2f} s (bound {bound_s:.2f} s) while a "
                             f"{len(big) >> 20} MiB body was refused")
    print(f"{reason}: {len(windows)} large requests, {len(overlapped)} completions alongside, worst {worst:.3f} s "
          f"(alone: median {alone_s:.3f} s)")


def test_slow_heads_and_bodies_are_cut_off(gw: RunningGateway) -> None:
    """Connections that never finish their request head are closed (header_timeout_s=2); a
    body that stops arriving gets 408 (body_timeout_s=10)."""
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
    # The knobs set where the static controller holds them (the gateway's initial ones, which it
    # proposes): what PID did in the tests before depends on this machine's speed and load, and
    # a cap it left below the static one (63 on a busy machine) could never walk back up over an
    # idle engine (the shield's step around the running batch), an intervention at every tick.
    r = httpx.post(f"{gw.url}/admin/freeze", json={"frozen": False, "knobs": {"batch_cap": 64, "bucketing": "fifo"},
                                                    "force": True}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    # Wait until the static setting is in force as proposed: no intervention (no 30 % step, no
    # stale-telemetry hold, no breaker) on the last decision and the knobs unchanged over two
    # counted ticks. Unchanged knobs alone were not enough: a stale scrape held the cap at 19 for
    # two ticks, then it walked on to 24.
    deadline = time.monotonic() + 90.0
    before = gw.status()["control"]
    while True:
        time.sleep(0.5)
        now = gw.status()["control"]
        knobs = [ln["knobs_in_force"] for ln in now["lanes"].values()]
        settled = (now["ticks"] >= before["ticks"] + 2
                   and knobs == [ln["knobs_in_force"] for ln in before["lanes"].values()]
                   and all(not ln.get("interventions") for ln in now["lanes"].values()))
        if settled:
            break
        assert time.monotonic() < deadline, f"the static controller never held the knobs: {now['lanes']}"
        if knobs != [ln["knobs_in_force"] for ln in before["lanes"].values()] or any(
                ln.get("interventions") for ln in now["lanes"].values()):
            before = now
    before = now
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


def _admin_routes() -> list[tuple[str, str]]:
    """(method, path) of every ``/admin/*`` route, read from the app (new ones are covered)."""
    from batchpilot.schemas.serve import ServeConfig
    from batchpilot.serving.gateway import AppSettings, build_app

    app = build_app(AppSettings(serve=ServeConfig.from_cfg({"managed": True})))
    out = [(m, r.path) for r in app.routes if getattr(r, "path", "").startswith("/admin")
           for m in sorted(getattr(r, "methods", None) or ())]
    assert {p for _, p in out} >= {"/admin/status", "/admin/policy/reload", "/admin/mode", "/admin/freeze",
                                   "/admin/kv_dtype", "/admin/reset", "/admin/quality/reset"}, out
    return out


def test_every_admin_route_requires_the_token(gw: RunningGateway) -> None:
    """Each route, each way of getting the token wrong, with a body that would change state:
    401 and nothing changed; the right token gets through (here: status only, a read)."""
    before = gw.status()["control"]
    token = AUTH["authorization"].removeprefix("Bearer ")
    for method, path in _admin_routes():
        for auth in (None, "Bearer nope", f"Basic {token}", f"Bearer {token}x", f"Bearer {token[:-1]}", "Bearer"):
            headers = {"content-type": "application/json", **({"authorization": auth} if auth is not None else {})}
            body = b'{"frozen": true, "force": true, "mode": "static", "dtype": "auto"}' if method == "POST" else None
            r = httpx.request(method, f"{gw.url}{path}", content=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["reason"] == "unauthorized", (method, path, auth)
    after = gw.status()["control"]
    for key in ("frozen", "mode", "acting", "policy_path"):
        assert after[key] == before[key], key
    assert httpx.get(f"{gw.url}/admin/status", headers=AUTH, timeout=30).status_code == 200


def _stat(pid: int) -> tuple[int, int, int] | None:
    """``(parent, process group, start time)`` of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[2]), int(rest[19])


def _processes() -> dict[int, tuple[int, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = st
    return out


def _descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid``: pid -> start time (a pid reused later is another process)."""
    procs = _processes()
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, _, start) in procs.items():
            if ppid == parent and p not in out:
                out[p] = start
                todo.append(p)
    return out


def _alive(procs: dict[int, int]) -> list[int]:
    return [p for p, start in procs.items() if (st := _stat(p)) is not None and st[2] == start]


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
    """Nothing of the engine outlives a killed gateway: not its processes, and not the folder of
    vLLM's socket files (``VLLM_RPC_BASE_PATH``, its own per launch; vLLM never removes the
    sockets, and a handful per start piled up in the temporary folder by the thousand)."""
    with running_gateway() as g:
        [pgid] = g.upstream_pids()
        assert _wait_gone(pgid, 0.5) is False  # the engine runs
        # The group's leader (the reaper) has the engine's environment.
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        ipc = Path(env[b"VLLM_RPC_BASE_PATH"].decode())
        assert ipc.name.startswith(IPC_DIR_PREFIX)
        assert any(p.is_socket() for p in ipc.iterdir()), "vLLM put no socket in its own folder"
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait(30)
        assert _wait_gone(pgid), "vllm serve outlived the gateway's SIGKILL"
        assert not ipc.exists(), "the engine's socket folder outlived it"


def test_sigterm_during_a_restart_leaves_no_engine() -> None:
    """The engine is killed, and the gateway is stopped while the restart's new engine starts:
    nothing of the new engine's process group (the reaper, ``vllm serve``, its engine-core
    children) and no process below the gateway outlives it."""
    with running_gateway("serve.health_interval_s=0.25") as g:
        [old] = g.upstream_pids()
        os.killpg(old, signal.SIGKILL)  # a crash: the gateway restarts it
        assert _wait_gone(old), "the killed engine's group did not end"
        # The restart's engine: a new process group, led by a child of the gateway.
        deadline = time.monotonic() + 120
        new = []
        while not new and time.monotonic() < deadline:
            new = [p for p, (ppid, pgid, _) in _processes().items() if ppid == g.proc.pid and pgid == p and p != old]
            time.sleep(0.05)
        assert new, "no restart began"
        [pgid] = new
        below = _descendants(g.proc.pid)
        assert pgid in below
        g.proc.send_signal(signal.SIGTERM)  # while the new engine is still starting
        g.proc.wait(120)
        assert _wait_gone(pgid), f"a process of the restarted engine's group {pgid} outlived the gateway"
        deadline = time.monotonic() + 120
        while _alive(below) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not _alive(below), f"processes started below the gateway outlived it: {_alive(below)}"
