"""The OpenAI-compatible gateway in front of vLLM (FastAPI app factory ``build_app``).

``/v1/completions`` and ``/v1/chat/completions`` are passed through byte for byte (streaming
SSE or not; the upstream's status codes, bodies and usage untouched) after three gateway steps:
validate the body, count the prompt tokens (bucketing and the length check), and wait in
admission for an in-flight slot. vLLM's read-only endpoints (``/tokenize``, ``/version``, ...)
are forwarded as they are; any other path is refused. Everything the gateway refuses itself is a ``GatewayError``
turned into JSON ``{"error": {"message", "type", "code", "reason"}}`` in one place.

The lifespan starts the upstreams (or waits for them), the health loop and the control loop,
and stops them in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import stat
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from batchpilot.core.engine import Request as EngineRequest
from batchpilot.core.knobs import Knobs
from batchpilot.core.telemetry import SLO, Telemetry
from batchpilot.schemas.control import ControlLoopConfig, check_no_moved_keys
from batchpilot.schemas.serve import ServeConfig, managed_engine_args
from batchpilot.serving.errors import BadRequest, ClientGone, GatewayError, Refused
from batchpilot.serving.http1 import Http1Error, Http1Response
from batchpilot.serving.http_server import GatewayServer, with_head_timeout
from batchpilot.serving.lanes import Lane
from batchpilot.serving.prom import CONTENT_TYPE, GatewayMetrics, bucket_name
from batchpilot.serving.request_body import (
    OFF_LOOP_BYTES,
    BodyInspector,
    BodyLimits,
    forwarded_priority,
    with_field,
    with_model,
)
from batchpilot.serving.tokens import PromptCounter, PromptTooLong
from batchpilot.serving.upstream import ManagedVLLM, Upstream, UpstreamDown, cpu_core_groups, free_port

log = logging.getLogger(__name__)

#: Request headers not forwarded upstream besides hop-by-hop ones (``http1.forwardable``) and
#: the gateway's own (priority, trusted key): credentials and encodings the gateway decides.
_DROP_HEADERS = frozenset({"authorization", "accept-encoding"})
#: Response headers not copied back (the ASGI server sets its own).
_DROP_RESP_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding",
                                "date", "server", "content-encoding"})


@dataclass
class AppSettings:
    """Everything ``build_app`` needs besides the serve config: the SLO, the control loop's
    interval, window and start knobs (the ``control`` group, the simulator's too) and the configs
    of the shield and the fallback controller (top-level nodes of ``conf/serve_app.yaml``)."""

    serve: ServeConfig
    slo: SLO = field(default_factory=SLO)
    control: ControlLoopConfig = field(default_factory=ControlLoopConfig)
    shield: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=lambda: {"kind": "pid"})

    @classmethod
    def from_cfg(cls, cfg: Any) -> "AppSettings":
        """From the composed ``serve_app`` config."""
        from omegaconf import OmegaConf

        c = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
        check_no_moved_keys(c)  # serve.control.interval_s & co.: the control group's now
        return cls(
            serve=ServeConfig.from_cfg(c["serve"]),
            slo=SLO.from_mapping(c.get("slo")),
            control=ControlLoopConfig.from_cfg(c.get("control") or {}),
            shield=dict(c.get("shield") or {}),
            policy=dict(c.get("policy") or {"kind": "pid"}),
        )


#: The managed engines' log folder inside the Hydra run's folder when ``serve.log_dir`` is unset.
ENGINE_LOG_SUBDIR = "engines"


def hydra_run_dir() -> Path | None:
    """The output folder of the Hydra run this process is (``scripts/serve.py``: by default
    ``outputs/<date>/<time>/``, beside Hydra's ``serve.log`` and ``.hydra/``); None outside one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def default_engine_log_dir(run_dir: Path | None) -> Path:
    """Where managed engines log when ``serve.log_dir`` is unset: a folder only this user can
    enter (mode 0700), one ``vllm-<port>.log`` per engine.

    In a Hydra app (``scripts/serve.py``; ``run_dir`` from ``hydra_run_dir``) it is
    ``<run_dir>/engines``: the run's output folder, where its user looks, gone when the run is.

    Outside one (a test or a library caller building a ``Gateway``) it is one folder per user,
    ``<tmp>/batchpilot-engines-<uid>``, reused by every such gateway. Not a fresh ``mkdtemp``
    folder per start, the old default: nobody removed them and hundreds piled up in /tmp. Not
    the working directory (logs would land wherever the caller runs, a repository for the
    tests), nor the home directory (kept forever; the system cleans its temporary folder). A
    name in /tmp is predictable and another user could make it first, to read or swap the logs:
    the folder is used only if it is a real folder (not a link) owned by this user, and is set
    to mode 0700; otherwise this raises, naming ``serve.log_dir``. ``<run_dir>/engines`` is
    checked the same way."""
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / ENGINE_LOG_SUBDIR
    else:
        path = Path(tempfile.gettempdir()) / f"batchpilot-engines-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) else \
            f"a folder of another user's (uid {st.st_uid})"
        raise ValueError(f"serve.log_dir is unset and its default, {path}, is {what}: remove it or set "
                         "serve.log_dir to a folder for the engines' logs")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def default_model_dir() -> str:
    from batchpilot.platform.tiny_model import build_tiny_model

    return str(build_tiny_model())


class Gateway:
    """The shared state on ``app.state.gateway``: lanes, prompt counter, metrics, loops."""

    def __init__(self, settings: AppSettings) -> None:
        self.settings = settings
        cfg = self.cfg = settings.serve
        self.metrics = GatewayMetrics()
        self.started = time.monotonic()
        self.ready = False
        self.model_dir = cfg.model
        self.log_dir: Path | None = None  # the managed engines' logs
        upstreams: list[Upstream] = []
        if cfg.managed:
            self.model_dir = self.model_dir or default_model_dir()
            name = cfg.served_model_name or Path(self.model_dir).name
            # Several CPU engines on one machine: give each its own cores (ignored on GPUs).
            cores = cpu_core_groups(cfg.num_managed) if cfg.num_managed > 1 else [None]
            # scripts/serve.py sets log_dir to its run's folder when unset (serve); this fallback is
            # for a gateway built outside a Hydra app (default_engine_log_dir says why there).
            shared = not cfg.log_dir
            if cfg.log_dir:
                self.log_dir = Path(cfg.log_dir).expanduser()
                self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # private when it is created here
            else:
                self.log_dir = default_engine_log_dir(None)
            for i in range(cfg.num_managed):
                port = cfg.managed_port_base + i if cfg.managed_port_base else free_port()
                if shared:  # an earlier gateway's log on this port: its error lines are not this engine's
                    (self.log_dir / f"vllm-{port}.log").unlink(missing_ok=True)
                proc = ManagedVLLM(
                    self.model_dir, port, served_model_name=name, max_model_len=cfg.max_model_len,
                    max_num_seqs=cfg.max_num_seqs, kv_dtype=cfg.kv_dtype,
                    kv_cache_space_gib=cfg.kv_cache_space_gib, max_num_batched_tokens=cfg.max_num_batched_tokens,
                    extra_args=managed_engine_args(cfg),  # + --scheduling-policy priority (forward_priority)
                    log_path=self.log_dir / f"vllm-{port}.log", cpu_cores=cores[i], api_key=cfg.upstream_api_key,
                )
                upstreams.append(Upstream(proc.url, managed=proc, name=f"vllm{i}", api_key=cfg.upstream_api_key))
        else:
            upstreams = [Upstream(u, name=f"vllm{i}", api_key=cfg.upstream_api_key) for i, u in enumerate(cfg.upstreams)]
        self.counter = PromptCounter(cfg.tokenizer, self.model_dir)
        ctl = settings.control
        knobs = Knobs(batch_cap=min(ctl.initial_batch_cap, cfg.max_num_seqs),
                      bucketing=ctl.initial_bucketing, kv_dtype=cfg.kv_dtype)
        self.lanes = [
            Lane.build(
                i, up, cfg.admission, knobs,
                Telemetry(settings.slo, num_buckets=cfg.admission.num_buckets, window_s=ctl.window_s,
                          max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                          rate_scale=ctl.rate_scale, token_rate_scale=ctl.token_rate_scale),
                self.metrics, cfg.retry_after_s,
            )
            for i, up in enumerate(upstreams)
        ]
        self._next_lane = 0  # round-robin among equally loaded lanes
        self._canary_credit = 0.0  # fixed-share routing while a canary is on trial
        from batchpilot.serving.supervisor import Supervisor

        self.supervisor = Supervisor(cfg, self.lanes, self.metrics)
        self.bodies = BodyInspector(cfg.max_num_seqs, cfg.body_workers,
                                    BodyLimits(cfg.max_json_containers, cfg.max_unknown_field_bytes))
        self.control = None  # the ControlLoop, set in the lifespan (needs running upstreams)
        self.quality = None
        #: A stop was asked for (SIGTERM, Ctrl-C): nothing new is admitted; requests in flight
        #: get ``serve.drain_s`` to finish (``drain_on_stop``).
        self.draining = False
        #: A second stop signal came (``hurry``): no more grace for requests or engines.
        self.hurried = False
        #: ``serve.control.fail_open`` and the control loop has failed: requests skip admission
        #: and go straight to a live engine (``_watch`` sets it).
        self.bypass_admission = False

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.bodies.start()
        await self.supervisor.start_all()
        now = time.monotonic()
        for ln in self.lanes:
            ln.telemetry.reset(now)
        from batchpilot.serving.control_loop import ControlLoop
        from batchpilot.serving.quality_guard import QualityGuard

        self.quality = QualityGuard(self.cfg.quality_guard, self.metrics, api_key=self.cfg.upstream_api_key)
        self.control = ControlLoop(self)
        await self.control.choose_start_kv_dtype()
        await self.control.start()
        self.supervisor.spawn(self._watch(), "batchpilot-watch")
        self.ready = True
        log.info("gateway ready on %s:%d in front of %s%s", self.cfg.host, self.cfg.port,
                 ", ".join(ln.upstream.url for ln in self.lanes),
                 f" (engine logs in {self.log_dir})" if self.log_dir else "")

    async def _watch(self) -> None:
        """Several times a second, cheap checks that must not wait for a /health probe: lanes
        stopped, hung or down too long (``Supervisor.check_lanes``), and whether the control
        loop has failed (``serve.control.fail_open``)."""
        period = min(self.cfg.health_interval_s, 0.25)
        fail_open = self.cfg.control.fail_open
        managed = [ln.upstream.managed for ln in self.lanes if ln.upstream.managed is not None]
        next_refresh = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if managed and now >= next_refresh:  # the engines' processes, for ManagedVLLM.stopped
                next_refresh = now + 5.0
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(lambda: [m.refresh_group() for m in managed])
                now = time.monotonic()
            try:
                self.supervisor.check_lanes(now)
            except Exception:  # a check that failed once must not end the watch
                log.exception("lane check failed")
            if fail_open and self.control is not None:
                failed = self.control.failed(now)
                if failed != self.bypass_admission:
                    log.error("the control loop has failed: requests now bypass admission (serve.control.fail_open)"
                              if failed else "the control loop runs again: admission is back")
                    self.bypass_admission = failed

    def hurry(self) -> None:
        """A second stop signal (Ctrl-C pressed again while the gateway drains or stops): the
        requests still in flight are ended now (``drain_on_stop`` watches ``hurried``) and the
        managed engines are killed instead of given vLLM's shutdown (``ManagedVLLM.hurry``).
        The stop then goes on as usual, so nothing is left running and no task is cancelled
        mid-answer (uvicorn's own "force quit" skipped the engines' stop and printed a traceback
        for each request cut). Runs in the signal handler: it only sets flags and sends signals."""
        self.hurried = True
        for ln in self.lanes:
            if ln.upstream.managed is not None:
                ln.upstream.managed.hurry()

    async def stop(self) -> None:
        self.ready = False
        if self.control is not None:
            await self.control.stop()
        if self.quality is not None:
            await self.quality.aclose()
        await self.supervisor.stop_all()
        await asyncio.to_thread(self.bodies.close, True)

    # --- routing ---------------------------------------------------------------------------
    def pick_lane(self) -> Lane:
        """The least-loaded lane that admits now, else one restarting (requests queue for it).
        Ties go round-robin: at light load every lane is empty, and "the first of the least
        loaded" sent all traffic to one upstream. While a canary policy is on trial its lanes
        get exactly its share of requests (``PolicyManager.canary_lanes``)."""
        open_ = [ln for ln in self.lanes if ln.available]
        canary = self.control.policies.canary_lanes(len(self.lanes)) if self.control is not None else None
        if canary is not None and len(open_) > 1:
            # A canary on trial gets a fixed share of requests, whatever its lanes' load.
            self._canary_credit += self.control.policies.canary.share
            to_canary = self._canary_credit >= 1.0
            if to_canary:
                self._canary_credit -= 1.0
            side = [ln for ln in open_ if (ln.index in canary) == to_canary]
            if side:
                return min(side, key=lambda ln: ln.load)
        if len(open_) > 1:
            self._next_lane = (self._next_lane + 1) % len(open_)
            rotated = open_[self._next_lane:] + open_[:self._next_lane]
            return min(rotated, key=lambda ln: ln.load)
        if open_:
            return open_[0]
        waiting = [ln for ln in self.lanes if ln.upstream.restarting or ln.upstream.stalled or
                   (ln.upstream.managed is not None and self.cfg.auto_restart)]
        ff = self.cfg.fail_fast_s
        if ff is not None:  # lanes down past the bound refuse at once
            now = time.monotonic()
            waiting = [ln for ln in waiting if ln.down_since is None or now - ln.down_since < ff or not ln.fails_fast]
        if waiting:
            return min(waiting, key=lambda ln: ln.load)
        raise Refused("upstream_down", "no upstream vLLM server is answering; retry later",
                      status=503, retry_after=self.cfg.retry_after_s)

    def max_model_len(self, lane: Lane) -> int:
        info = lane.upstream.info
        return info.max_model_len if info and info.max_model_len else self.cfg.max_model_len


# --- request validation -----------------------------------------------------------------------
async def _read_body(request: Request, cfg: ServeConfig) -> bytes:
    """The request body, refused with 413 above ``max_body_bytes`` (before reading it when the
    client says its length) and with 408 when it does not arrive within ``body_timeout_s``: a
    50 MB prompt froze the gateway for a minute, and half-open bodies were held forever."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
        raise _too_large(int(declared), cfg)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > cfg.max_body_bytes:
                    raise _too_large(size, cfg)
                chunks.append(chunk)
    except TimeoutError:
        raise GatewayError("body_timeout", f"the request body did not arrive within {cfg.body_timeout_s:g} s",
                           status=408) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _check_media_type(request: Request) -> None:
    """A body that is not sent as JSON is refused as vLLM refuses it (its ``validate_json_request``:
    the media type exactly ``application/json``, parameters aside), before it takes a slot in
    admission only for vLLM to refuse it then; a form-encoded body was called "not valid JSON"."""
    media_type = request.headers.get("content-type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        raise BadRequest("unsupported_media_type", "Unsupported Media Type: Only 'application/json' is allowed")


def _too_large(size: int, cfg: ServeConfig) -> GatewayError:
    return GatewayError("body_too_large", f"the request body has {size} bytes or more; the limit is "
                        f"serve.max_body_bytes={cfg.max_body_bytes}", status=413)


def expected_output_len(max_tokens: int | None, chat: bool, prompt_len: int, max_model_len: int) -> int:
    """The most tokens a request may generate, as vLLM decides it: ``max_tokens`` when the
    client sent it; else vLLM's defaults, 16 for ``/v1/completions`` (its ``CompletionRequest``
    default) and the rest of the context for chat (``max_model_len - prompt``). Admission
    charges every request its KV at this length, so the memory check holds for the worst case."""
    if max_tokens is not None:
        return max(1, min(int(max_tokens), max(max_model_len - prompt_len, 1)))
    return 16 if not chat else max(max_model_len - prompt_len, 1)


def _priority(request: Request, cfg: ServeConfig) -> int:
    """The request's priority. Anyone may lower their own importance; a priority above the
    default (a smaller number; 0 = core, never shed) needs a trusted key, or any client could
    opt out of load shedding."""
    raw = request.headers.get(cfg.priority_header)
    if raw is None:
        return cfg.default_priority
    try:
        p = int(raw)
    except ValueError:
        raise BadRequest("invalid_header", f"header {cfg.priority_header} must be an integer, got {raw[:40]!r}") from None
    if p < 0:
        raise BadRequest("invalid_header", f"header {cfg.priority_header} must be >= 0 (0 = core), got {p}")
    if p < cfg.default_priority and not cfg.is_trusted(request.headers.get(cfg.trusted_key_header)):
        raise GatewayError(
            "priority_not_allowed",
            f"{cfg.priority_header}: {p} is above the default priority {cfg.default_priority}; it needs a trusted "
            f"key in header {cfg.trusted_key_header}", status=403)
    return p


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message the
    server delivers is ``http.disconnect``)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _DisconnectGuard:
    """Cancels the handler's task when the client disconnects (then ``gone`` is True), so a
    queued request leaves the queue and an upstream call is aborted. One watcher task per
    request, no extra task around the work itself (the hot path stays cheap)."""

    __slots__ = ("task", "gone", "watcher")

    def __init__(self, request: Request) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.watcher = asyncio.ensure_future(_until_disconnect(request))
        self.watcher.add_done_callback(self._on_done)

    def _on_done(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.gone = True
            self.task.cancel()

    def close(self) -> None:
        self.watcher.remove_done_callback(self._on_done)
        self.watcher.cancel()


# --- the proxy ------------------------------------------------------------------------------
async def _proxy(request: Request, path: str, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    cfg = gw.cfg
    t_arrival = time.monotonic()
    deadline = t_arrival + cfg.request_timeout_s
    raw = await _read_body(request, cfg)
    _check_media_type(request)
    parsed = await gw.bodies.inspect(raw, chat, max(gw.max_model_len(ln) for ln in gw.lanes))
    body, raw = parsed.body, parsed.raw
    priority = _priority(request, cfg)
    lane = gw.pick_lane()
    info = lane.upstream.info
    if "model" not in body and info is not None:
        body["model"] = info.model
        raw = with_model(parsed, info.model)
    if cfg.forward_priority or "priority" in body:
        # A client's own body priority is checked whether or not the gateway forwards classes: an
        # engine an operator started on --scheduling-policy priority obeys it either way.
        add = forwarded_priority(body, priority, cfg.is_trusted(request.headers.get(cfg.trusted_key_header)),
                                 cfg.trusted_key_header)
        if add is not None and cfg.forward_priority:  # the engine runs priority: tell it the class
            raw = with_field(raw, parsed.brace, "priority", add)
    max_len = gw.max_model_len(lane)
    try:
        prompt_len = await gw.counter.count(body, chat, lane.upstream.tokenize, limit=max_len, text=parsed.text,
                                            off_loop=len(raw) > OFF_LOOP_BYTES)
    except PromptTooLong as exc:
        raise BadRequest("prompt_too_long", str(exc)) from None
    except UpstreamDown as exc:
        raise Refused("upstream_down", str(exc), status=503, retry_after=cfg.retry_after_s) from None
    except ValueError as exc:  # the upstream's /tokenize refused it
        raise BadRequest("invalid_prompt", f"could not tokenize the prompt: {exc}") from None
    # vLLM (and OpenAI) read max_completion_tokens first, max_tokens when it is not set.
    limit_key = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    max_tokens = None if limit_key is None else body[limit_key]
    if prompt_len > max_len:
        raise BadRequest("prompt_too_long",
                         f"the prompt has {prompt_len} tokens, more than the model's max_model_len={max_len}")
    if max_tokens is not None and max_tokens > max_len:
        raise BadRequest("max_tokens_too_large",
                         f"{limit_key}={max_tokens} exceeds the model's max_model_len={max_len}", param=limit_key)
    rid = f"gw-{uuid.uuid4().hex}"
    cap = expected_output_len(max_tokens, chat, prompt_len, max_len)  # what admission charges (max_tokens)
    req = EngineRequest(rid, t_arrival, prompt_len, cap, priority, num_seqs=parsed.seqs,
                        reports_first_token=bool(body.get("stream")), max_tokens=cap)
    bucket = lane.admission.bucket_of(prompt_len)
    guard = _DisconnectGuard(request)
    admitted: list[bool] = [False]
    try:
        drop = _DROP_HEADERS | {cfg.trusted_key_header, cfg.priority_header}
        headers = [(k, v) for k, v in request.headers.items() if k not in drop] + lane.upstream.auth_headers
        return await _forward(gw, lane, req, bucket, body, raw, headers, path, deadline, admitted)
    except asyncio.CancelledError:
        if guard.gone:
            # A queued request was already counted "cancelled" by its lane.
            raise ClientGone(counted=not admitted[0]) from None
        raise
    finally:
        guard.close()


async def _forward(gw: Gateway, lane: Lane, req: EngineRequest, bucket: int, body: dict[str, Any], raw: bytes,
                   headers: list[tuple[str, str]], path: str, deadline: float, admitted: list[bool]) -> Response:
    """Wait for a slot, call the upstream, answer (or start relaying the stream)."""
    cfg = gw.cfg
    t_arrival = req.arrival_time
    if gw.draining:
        raise Refused("shutting_down", "the gateway is shutting down; retry later", status=503,
                      retry_after=cfg.retry_after_s)
    if gw.bypass_admission and lane.available:  # fail open: the control loop has failed
        lane.telemetry.on_arrival(time.monotonic(), req.prompt_len)
    elif lane.available or cfg.fail_fast_s is None or not lane.fails_fast:
        await lane.acquire(req, deadline)
    else:
        await _acquire_down(lane, req, deadline, cfg.fail_fast_s)
    admitted[0] = True
    stream = bool(body.get("stream"))
    timer = _Timer(gw, lane, req, bucket, t_arrival, stream)
    sampled = (gw.quality.maybe_sample(lane, body, path.endswith("chat/completions"), req.prompt_len)
               if gw.quality else None)
    if sampled is not None and cfg.forward_priority:  # else a priority engine runs the replay first (0)
        from batchpilot.serving.quality_guard import REPLAY_PRIORITY

        sampled.body["priority"] = REPLAY_PRIORITY
    try:
        resp, content = await _send_until(lane, path, headers, raw, stream, deadline)
        t_recv = time.monotonic()
        if resp.status < 500:
            lane.upstream.last_answer = t_recv
    except TimeoutError:
        timer.finish(ok=False)
        gw.metrics.rejected.labels("timeout").inc()
        raise Refused("timeout", "the upstream did not answer within the request timeout", status=503,
                      retry_after=cfg.retry_after_s) from None
    except Http1Error as exc:
        timer.finish(ok=False)
        _upstream_failed(lane, exc, _stop_cut(gw) if gw.draining else None)
    except BaseException:
        timer.finish(ok=False)
        raise
    resp_headers = {k: v for k, v in resp.headers if k not in _DROP_RESP_HEADERS}
    if content is not None:
        if resp.status >= 400:
            lane.check_error_answer(resp.status, content)  # an OOM answer feeds the breaker
        timer.finish(ok=resp.status == 200, content=content)
        if sampled is not None and resp.status == 200:
            gw.quality.submit(sampled)
        # Time spent in the gateway itself (before the upstream call and after it), and waiting
        # for the upstream (W3C Server-Timing), so a client can split its latency per request.
        resp_headers["x-gateway-overhead-ms"] = f"{(timer.t_send - t_arrival + time.monotonic() - t_recv) * 1e3:.3f}"
        resp_headers["server-timing"] = f"upstream;dur={(t_recv - timer.t_send) * 1e3:.3f}"
        return Response(content, status_code=resp.status, headers=resp_headers)
    if sampled is not None:
        gw.quality.submit(sampled)
    def on_close() -> None:
        timer.finish(ok=False)  # a no-op when the stream ended normally (finished already)
        resp.aclose()

    return SlotStream(_relay(resp, timer, lane, deadline, cfg.request_timeout_s, gw), on_close, status_code=200,
                      headers=resp_headers)


async def _acquire_down(lane: Lane, req: EngineRequest, deadline: float, fail_fast_s: float) -> None:
    """Wait for a slot on a lane that cannot serve now, at most ``fail_fast_s`` past when it
    went down: then 503 ``upstream_down`` with Retry-After, not a wait until the request times out."""
    now = time.monotonic()
    until = (lane.down_since if lane.down_since is not None else now) + fail_fast_s
    try:
        await lane.acquire(req, min(deadline, max(until, now)))
    except Refused as exc:
        if exc.reason != "timeout" or until >= deadline:
            raise
        raise Refused("upstream_down", f"upstream {lane.name} cannot serve (stopped, restarting or not answering); "
                      "retry later", status=503, retry_after=lane.retry_after_s) from None


class SlotStream(StreamingResponse):
    """A streamed answer that frees its admission slot however the response ends: Starlette
    cancels a stream whose client left before its first byte without ever starting the body's
    generator, so the generator's own clean-up never ran and the slot leaked."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _send_until(lane: Lane, path: str, headers: list[tuple[str, str]], raw: bytes, stream: bool,
                      deadline: float) -> tuple[Http1Response, bytes | None]:
    """Send before ``deadline``; read the whole body too unless it is a successful stream
    (``None`` content then). A cancelled read closes the connection: vLLM aborts the request."""
    async with asyncio.timeout_at(deadline):  # the loop's clock is time.monotonic
        resp = await lane.upstream.pool.request("POST", path, headers, raw)
        if stream and resp.status == 200:
            return resp, None
        try:
            return resp, await resp.read()
        except BaseException:
            resp.aclose()
            raise


def _stop_cut(gw: Gateway) -> str:
    """When a stop ended a request in flight, for its client's error message."""
    return "at the gateway's second stop signal" if gw.hurried else f"after {gw.cfg.drain_s:g} s of grace"


def _upstream_failed(lane: Lane, exc: Exception, stop_cut: str | None = None) -> None:
    """An in-flight request lost its upstream: fail fast and mark the lane unhealthy (or, while
    the gateway stops, it was ended by the stop, ``stop_cut`` says when: 503 to retry elsewhere)."""
    if stop_cut is not None:
        raise Refused("shutting_down", f"the gateway is shutting down; the request was ended {stop_cut}; "
                      "retry later", status=503, retry_after=lane.retry_after_s) from None
    if not lane.available and isinstance(exc, Http1Error):  # ended by the gateway (Supervisor.check_lanes)
        raise Refused("upstream_down", f"upstream {lane.name} stopped answering (stopped or hung); retry later",
                      status=503, retry_after=lane.retry_after_s) from None
    if isinstance(exc, (httpx.ConnectError,)) or getattr(exc, "connect", False):
        lane.upstream.healthy = False
        raise Refused("upstream_down", f"upstream {lane.name} refused the connection: {exc}",
                      status=503, retry_after=lane.retry_after_s) from None
    raise GatewayError("upstream_error", f"upstream {lane.name} failed mid-request: {exc}",
                       status=502, retry_after=lane.retry_after_s) from None


async def _relay(resp: Http1Response, timer: "_Timer", lane: Lane, deadline: float,
                 idle_s: float, gw: Gateway | None = None) -> AsyncIterator[bytes]:
    """Relay SSE chunks as they come; the slot is freed however the stream ends (and an
    unfinished upstream stream is closed, so vLLM aborts it). A stream that keeps sending is
    never cut: past the request's deadline it ends only once no chunk came for ``idle_s``
    (a long generation streams for as long as vLLM would let it)."""
    ok = False
    it = resp.aiter()
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            deadline = max(deadline, time.monotonic() + idle_s)
            timer.chunk(chunk)
            if b'"error"' in chunk:  # vLLM ends a failed stream with an error event
                lane.check_stream_error(chunk)
            yield chunk
        ok = True
    except TimeoutError:
        lane.metrics.rejected.labels("timeout").inc()
        yield _sse_error(f"no chunk from the upstream for {idle_s:g} s (serve.request_timeout_s) mid-stream",
                         "timeout", 503)
    except Http1Error as exc:
        # Headers are gone already: end the stream with an SSE error event, as vLLM does.
        if gw is not None and gw.draining:
            yield _sse_error(f"the gateway is shutting down; the stream was ended {_stop_cut(gw)}",
                             "shutting_down", 503)
        else:
            yield _sse_error(f"upstream {lane.name} failed mid-stream: {exc}", "upstream_error", 502)
    finally:
        timer.finish(ok=ok)
        resp.aclose()


def _sse_error(message: str, reason: str, code: int) -> bytes:
    err = {"error": {"message": message, "type": "GatewayError", "code": code, "reason": reason}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


class _Timer:
    """Times one request for telemetry and the latency histograms, and frees its slot once."""

    __slots__ = ("gw", "lane", "req", "bucket", "t0", "t_send", "t_first", "n_chunks", "stream", "done", "usage_tokens")

    def __init__(self, gw: Gateway, lane: Lane, req: EngineRequest, bucket: int, t0: float, stream: bool) -> None:
        self.gw, self.lane, self.req, self.bucket, self.t0, self.stream = gw, lane, req, bucket, t0, stream
        self.t_send = time.monotonic()
        gw.metrics.admission_wait.labels(bucket_name(bucket)).observe(self.t_send - t0)
        self.t_first: float | None = None
        self.n_chunks = 0
        self.done = False
        self.usage_tokens: int | None = None

    def chunk(self, data: bytes) -> None:
        if self.t_first is None:
            # The first token reaches telemetry when it arrives, as in the env (the engine's
            # first token): a growing queue shows before the slow requests finish.
            self.t_first = time.monotonic()
            self.lane.telemetry.on_first_token(self.req.request_id, self.t_first, self.t_first - self.t0)
            self.lane.on_first_token(self.req.request_id, self.t_first)
        self.n_chunks += data.count(b"data: ")
        if b'"usage"' in data:
            self.usage_tokens = _completion_tokens(data)

    def finish(self, ok: bool, content: bytes | None = None) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        if not ok:
            self.lane.release(self.req.request_id)
            self.lane.telemetry.on_abandoned(self.req.request_id)
            return
        if content is not None:
            used = _completion_tokens(content)  # what it generated, when the answer says (usage)
            n = used or self.req.output_len
            # Non-streaming: the first token is not visible; attribute one n-th of the upstream
            # time to it (prefill ~ one decode step on short prompts). An estimate, documented.
            up = now - self.t_send
            ttft = (self.t_send - self.t0) + up / max(n, 1)
            tpot = up / max(n, 1)
        else:
            n = used = self.usage_tokens or max(self.n_chunks - 2, 1)
            first = self.t_first or now
            ttft = first - self.t0
            tpot = (now - first) / max(n - 1, 1) if n > 1 else 0.0
        # Freed with what it generated: admission's output estimate (charge: estimate) learns
        # from finished answers only, as the simulator's env feeds it its finished requests.
        self.lane.release(self.req.request_id, used)
        e2el = now - self.t0
        tel = self.lane.telemetry
        tel.on_output_tokens(n)
        tel.on_finished(self.req.request_id, now, ttft, tpot, e2el, self.req.priority)  # judged by its class's SLO
        m = self.gw.metrics
        b = bucket_name(self.bucket)
        m.ttft.labels(b).observe(ttft)
        m.e2el.labels(b).observe(e2el)


def _completion_tokens(data: bytes) -> int | None:
    i = data.rfind(b'"completion_tokens":')
    if i < 0:
        return None
    j = i + len(b'"completion_tokens":')
    k = j
    while k < len(data) and data[k : k + 1] in b" 0123456789":
        k += 1
    try:
        return int(data[j:k])
    except ValueError:
        return None


# --- the app ----------------------------------------------------------------------------------
class StatusCounter:
    """ASGI middleware counting every answer by path and status in one place: errors, 413s,
    a client gone before the answer (499) and the last-resort 500 included. A path the app has
    no route for counts as "other" (a client choosing the label would grow the metric without
    bound)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._paths: frozenset[str] | None = None  # the app's routes, read on the first request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except BaseException:
            status = status or 500
            raise
        finally:
            app = scope["app"]
            gw = getattr(app.state, "gateway", None)
            if gw is not None:
                if self._paths is None:
                    self._paths = frozenset(getattr(r, "path", "") for r in app.routes)
                path = scope["path"] if scope["path"] in self._paths else "other"
                gw.metrics.requests.labels(path, str(status or 499)).inc()


def _error_response(exc: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    body = {"error": {"message": exc.message, "type": type(exc).__name__, "param": exc.param, "code": exc.status,
                      "reason": exc.reason}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


#: vLLM's read-only endpoints, forwarded as they are: they generate nothing, so admission and
#: the shield have nothing to decide, and clients written for `vllm serve` use them.
FORWARDED = (("GET", "/v1/models"), ("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"))
#: What ``unknown_endpoint`` errors list.
SERVED_ENDPOINTS = ("/v1/completions and /v1/chat/completions (through admission and the shield), "
                    f"{', '.join(p for _, p in FORWARDED)} (forwarded to vLLM), /health, /ping, "
                    "/healthz, /readyz, /metrics and /admin/*")


def _shown(path: str, limit: int = 200) -> str:
    """A client's path as an error message quotes it: bounded, so a long one is not echoed whole."""
    return path if len(path) <= limit else path[:limit] + "..."


def _ready(gw: Gateway) -> bool:
    return gw.ready and any(ln.available for ln in gw.lanes)


async def _pass_through(request: Request, method: str, path: str) -> Response:
    """Forward a read-only request to one upstream and its answer back as it came, after the
    generation routes' limits: the body's size and arrival, its JSON's containers and unknown
    fields, and the prompt's length (``/tokenize``: at most ``max_model_len`` tokens, counted
    as for a completion; ``/detokenize``: as many token ids). A 7.5 MB prompt sent to vLLM's
    /tokenize held its API server for 10 s, and every completion beside it waited."""
    gw: Gateway = request.app.state.gateway
    raw: bytes | None = await _read_body(request, gw.cfg)  # a GET's body too: bounded, then dropped
    if method == "POST":
        _check_media_type(request)
        raw = await _checked_forward_body(gw, raw, path)
    else:
        raw = None
    lane = gw.pick_lane()
    if not lane.available:
        raise Refused("upstream_down", f"upstream {lane.name} cannot serve now; retry later", status=503,
                      retry_after=gw.cfg.retry_after_s)
    headers = {"content-type": "application/json"} if raw is not None else None
    try:
        r = await lane.upstream.client.request(method, path, content=raw, headers=headers,
                                               params=request.url.query or None, timeout=gw.cfg.request_timeout_s)
    except httpx.TimeoutException:
        raise Refused("timeout", f"upstream {lane.name} did not answer {path} within "
                      f"serve.request_timeout_s={gw.cfg.request_timeout_s:g} s", status=503,
                      retry_after=lane.retry_after_s) from None
    except httpx.HTTPError as exc:
        _upstream_failed(lane, exc)
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type", "application/json"))


async def _checked_forward_body(gw: Gateway, raw: bytes, path: str) -> bytes:
    """A forwarded POST body checked as a generation body is (``_pass_through``); the bytes to
    send on (UTF-8)."""
    max_len = max(gw.max_model_len(ln) for ln in gw.lanes)
    route = path.strip("/")
    parsed = await gw.bodies.inspect(raw, False, max_len, route=route)  # FORWARDED: POST is these two
    if parsed.body:  # /tokenize with a prompt of a type the gateway can count
        lane = gw.lanes[0]
        try:
            n = await gw.counter.count(parsed.body, parsed.chat, lane.upstream.tokenize, limit=max_len,
                                       text=parsed.text, off_loop=len(parsed.raw) > OFF_LOOP_BYTES)
        except PromptTooLong as exc:
            raise BadRequest("prompt_too_long", str(exc)) from None
        except UpstreamDown as exc:
            raise Refused("upstream_down", str(exc), status=503, retry_after=gw.cfg.retry_after_s) from None
        except ValueError as exc:
            raise BadRequest("invalid_prompt", f"could not tokenize the prompt: {exc}") from None
        if n > max_len:
            raise BadRequest("prompt_too_long", f"the prompt has {n} tokens, more than the model's max_model_len={max_len}")
    return parsed.raw


async def _start_unless_stopped(gw: Gateway, stop_requested: Callable[[], bool] | None) -> None:
    """``gw.start()`` (upstreams up and healthy: up to ``serve.startup_timeout_s``), given up as
    soon as ``stop_requested`` says the server was asked to stop (Ctrl-C, SIGTERM)."""
    start = asyncio.ensure_future(gw.start())
    while stop_requested is not None and not start.done():
        await asyncio.wait({start}, timeout=0.2)
        if not start.done() and stop_requested():
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            raise GatewayStopped("asked to stop while starting: the upstreams were not up yet")
    await start


class GatewayStopped(RuntimeError):
    """A stop was asked for before the gateway finished starting."""


#: Seconds uvicorn's own grace at a stop adds to ``serve.drain_s``; that grace is never reached:
#: when it was, uvicorn cancelled the streams, each client's answer was cut mid-chunk and each
#: cancellation logged a 50-line "Exception in ASGI application".
UVICORN_GRACE_MARGIN_S = 4


def uvicorn_graceful_shutdown_s(drain_s: float) -> int:
    """uvicorn's ``timeout_graceful_shutdown`` for a gateway that drains ``drain_s``: past the
    drain, so the gateway always ends its requests itself (in its error form) before uvicorn
    would cancel them."""
    return math.ceil(drain_s) + UVICORN_GRACE_MARGIN_S


async def drain_on_stop(gw: Gateway, stop_requested: Callable[[], bool], poll_s: float = 0.1) -> None:
    """Once ``stop_requested`` says so: refuse what is queued (503 ``shutting_down``, so a
    client or balancer retries elsewhere) and what arrives, give requests in flight
    ``serve.drain_s`` to finish, then end the rest by closing their upstream calls (vLLM
    aborts them; their clients get the gateway's error form)."""
    while not stop_requested():
        await asyncio.sleep(poll_s)
    gw.draining = True
    for ln in gw.lanes:
        ln.fail_all_waiting("shutting_down", "the gateway is shutting down; retry later")

    def in_flight() -> int:
        return sum(ln.admission.num_in_flight for ln in gw.lanes)

    drain_s = gw.cfg.drain_s
    if in_flight():
        log.info("stopping: %d request(s) in flight get up to %g s to finish (serve.drain_s)", in_flight(), drain_s)
    t0 = time.monotonic()
    while in_flight() and time.monotonic() < t0 + drain_s and not gw.hurried:
        await asyncio.sleep(poll_s)
    ended = sum(ln.upstream.pool.abort_busy() for ln in gw.lanes)
    if ended:
        after = f"{time.monotonic() - t0:.1f} s, at a second stop signal" if gw.hurried else f"{drain_s:g} s"
        log.warning("stopping: ended %d request(s) still in flight after %s", ended, after)


def _lifespan(settings: AppSettings) -> Callable[[FastAPI], Any]:
    """The app's lifespan: start the gateway (upstreams, health and control loops), drain it at a
    stop signal, stop it on the way out. A factory, so ``build_app`` only wires the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = Gateway(settings)
        app.state.gateway = gw
        try:
            try:
                await _start_unless_stopped(gw, getattr(app.state, "stop_requested", None))
            except GatewayStopped as e:
                # uvicorn is already stopping: it shuts down as soon as start-up returns. Raising
                # here instead would print "Application startup failed" and a traceback.
                log.warning("%s", e)
            except UpstreamDown as e:
                # An engine that never came up (a bad vLLM flag, a missing model, an unmanaged
                # upstream that does not answer): ``serve`` reports it in one line and exits.
                start_failed = getattr(app.state, "start_failed", None)
                if start_failed is None:
                    raise
                start_failed(str(e))
            stop_requested = getattr(app.state, "stop_requested", None)
            drain = asyncio.ensure_future(drain_on_stop(gw, stop_requested)) if stop_requested else None
            try:
                yield
            finally:
                if drain is not None:
                    drain.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await drain
        finally:
            await gw.stop()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers in the gateway's JSON form (``_error_response``) with a reason, and
    the refusals the gateway makes itself are counted in ``batchpilot:requests_rejected``."""

    @app.exception_handler(GatewayError)
    async def _on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        gw: Gateway = request.app.state.gateway
        if exc.status < 500 and exc.status not in (429,):  # load refusals count where they happen
            gw.metrics.rejected.labels(exc.reason).inc()
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        """The last resort: a bug in the gateway still answers JSON with a reason (and the
        traceback is logged), never a plain-text 500."""
        log.error("unexpected error on %s: %r", request.url.path, exc, exc_info=exc)
        return _error_response(GatewayError("internal_error", f"the gateway failed: {type(exc).__name__}",
                                            status=500))

    @app.exception_handler(StarletteHTTPException)
    async def _on_no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """A path or method the gateway has no route for answers in the gateway's error form and
        says what it serves: vLLM's other endpoints (its other generation APIs, which would
        bypass admission and the shield, and engine control such as /sleep) are not forwarded."""
        if exc.status_code == 404:
            err = GatewayError("unknown_endpoint", f"{_shown(request.url.path)} is not an endpoint of the "
                               f"batchpilot gateway; it serves {SERVED_ENDPOINTS}", status=404)
        elif exc.status_code == 405:
            err = GatewayError("method_not_allowed", f"{request.method} is not allowed on "
                               f"{_shown(request.url.path)}", status=405)
        else:
            err = GatewayError("http_error", str(exc.detail), status=exc.status_code)
        request.app.state.gateway.metrics.rejected.labels(err.reason).inc()
        resp = _error_response(err)
        resp.headers.update(exc.headers or {})  # 405's Allow
        return resp

    @app.exception_handler(ClientGone)
    async def _on_client_gone(request: Request, exc: ClientGone) -> Response:
        if not exc.counted:
            request.app.state.gateway.metrics.rejected.labels("client_gone").inc()
        return Response(status_code=499)


def _add_openai_routes(app: FastAPI) -> None:
    """The generation routes (through admission and the shield) and vLLM's read-only endpoints
    (``FORWARDED``, passed through after the same body checks)."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _proxy(request, "/v1/chat/completions", chat=True)

    async def forwarded(request: Request) -> Response:
        return await _pass_through(request, request.method, request.url.path)

    for method, path in FORWARDED:
        app.add_api_route(path, forwarded, methods=[method], name=path)


def _add_probe_routes(app: FastAPI) -> None:
    """Liveness and readiness (vLLM's /health and /ping, and the gateway's /healthz, /readyz)
    and /metrics: what load balancers, orchestrators and Prometheus poll."""

    @app.get("/health")
    async def health(request: Request) -> Response:
        """vLLM's liveness route, answered as `vllm serve` answers it (200, empty body) while
        the gateway can serve, so probes written for vLLM work unchanged in front of it."""
        return Response(status_code=200 if _ready(request.app.state.gateway) else 503)

    # vLLM's SageMaker-style probe: the same answer as /health, on GET and POST as vLLM takes it.
    app.add_api_route("/ping", health, methods=["GET", "POST"], name="/ping")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        gw: Gateway = request.app.state.gateway
        ups = {ln.name: {"url": ln.upstream.url, "healthy": ln.upstream.healthy,
                         "restarting": ln.upstream.restarting, "stalled": ln.upstream.stalled} for ln in gw.lanes}
        ready = _ready(gw)
        return JSONResponse({"ready": ready, "upstreams": ups}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.gateway.metrics.render(), media_type=CONTENT_TYPE)


def build_app(settings: AppSettings) -> FastAPI:
    """The gateway app. The lifespan starts upstreams, health and control loops; the routes are
    added in the order they always were (generation, forwarded, probes, metrics, admin)."""
    app = FastAPI(title="batchpilot gateway", lifespan=_lifespan(settings), docs_url=None, redoc_url=None)
    app.add_middleware(StatusCounter)
    _add_error_handlers(app)
    _add_openai_routes(app)
    _add_probe_routes(app)

    from batchpilot.serving.admin import router as admin_router

    app.include_router(admin_router)
    return app


class ServeConfigError(ValueError):
    """The gateway's configuration cannot run; the message names the key (``scripts/serve.py``
    prints it in one line)."""


class GatewayStartFailed(RuntimeError):
    """The gateway could not start serving: an upstream never came up. The message says why in
    one line (``scripts/serve.py`` prints it; the engine's log has the rest)."""


def _looks_like_a_path(model: str) -> bool:
    """Whether ``serve.model`` names a folder rather than a Hugging Face id (``org/name``)."""
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1


def _check_model(cfg: ServeConfig) -> None:
    """A ``serve.model`` folder that is not there fails here, not after vLLM has started and
    died on it (a 20-second wait, then its traceback)."""
    if cfg.model and _looks_like_a_path(cfg.model) and not Path(cfg.model).expanduser().is_dir():
        raise ValueError(f"serve.model={cfg.model!r}: no such folder (a model folder with config.json; "
                         "null = the built-in tiny model)")


def bind_listener(host: str, port: int) -> Any:
    """The gateway's listening socket, bound (not yet listening: a client connecting while the
    upstreams start is refused, as before) before anything starts, so a port in use or a host
    that does not resolve fails at once in one line. uvicorn binds only after the lifespan has
    started the engines: the gateway waited a minute for vLLM, logged "gateway ready", then
    failed to bind. Made as uvicorn's own ``Config.bind_socket`` makes it."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise ServeConfigError(f"cannot listen on {host}:{port} (serve.host, serve.port): {why}") from None
    sock.set_inheritable(True)
    return sock


def serve(cfg: Any) -> None:
    """Run the gateway until interrupted (``scripts/serve.py``)."""
    import uvicorn

    from batchpilot.core.shield import ShieldConfig
    from batchpilot.schemas import check_app
    from batchpilot.schemas.serve import ServeApp

    try:  # everything checkable before a port is bound or an engine starts
        check_app(ServeApp, cfg)  # a key added with +key=... (the rest was checked at compose)
        settings = AppSettings.from_cfg(cfg)
        ShieldConfig.from_cfg(settings.shield)
        _check_model(settings.serve)
        if settings.serve.managed and not settings.serve.log_dir:  # the engines' logs: in the run's folder
            settings.serve.log_dir = str(default_engine_log_dir(hydra_run_dir()))
    except ValueError as e:
        raise ServeConfigError(str(e)) from None
    sock = bind_listener(settings.serve.host, settings.serve.port)
    settings.serve.port = sock.getsockname()[1]  # serve.port=0: the port the system chose
    logging.basicConfig(level=settings.serve.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call otherwise
    app = build_app(settings)

    hurried: list[bool] = []

    def hurry() -> None:  # a second stop signal (GatewayServer): no more grace
        if not hurried:  # one line, however often the key is pressed
            hurried.append(True)
            log.warning("second stop signal: ending the requests in flight and the engines now")
        gw: Gateway | None = getattr(app.state, "gateway", None)
        if gw is not None:
            gw.hurry()

    server = GatewayServer(uvicorn.Config(
        app, host=settings.serve.host, port=settings.serve.port, log_level=settings.serve.log_level,
        access_log=False, timeout_graceful_shutdown=uvicorn_graceful_shutdown_s(settings.serve.drain_s),
        http=with_head_timeout(settings.serve.header_timeout_s, settings.serve.max_header_bytes),
        # Longer than clients' idle pools keep connections: a server-side close racing a
        # client's reuse of the connection shows up as a reset at the client.
        timeout_keep_alive=75), on_hurry=hurry)
    # uvicorn takes SIGINT/SIGTERM during start-up but acts on them only once the lifespan has
    # started: the lifespan watches this instead of waiting out serve.startup_timeout_s.
    app.state.stop_requested = lambda: server.should_exit
    failures: list[str] = []

    def start_failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True  # uvicorn shuts down as soon as start-up returns

    app.state.start_failed = start_failed
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn stopped in order (drain, engines), then raised the signal again, which
        # ends asyncio's run this way. The normal end of a gateway, as ``uvicorn.run`` takes it.
        pass
    finally:
        sock.close()
    if failures:
        raise GatewayStartFailed(failures[0])
