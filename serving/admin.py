"""The admin API (``/admin/*``): policy reload / canary, mode switch, freeze knobs, status.

Behind a bearer token (``$BATCHPILOT_ADMIN_TOKEN`` or the file ``serve.admin_token_file``);
without a configured token the admin API is off (403). Every body is checked whole before
anything changes (pydantic models, strict types, unknown keys refused): a bad call is a JSON 400
saying what was wrong and leaves the gateway as it was. Policies are loaded by
``PolicyRuntime`` from safetensors + JSON: nothing is ever unpickled.
"""

from __future__ import annotations

import hmac
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from batchpilot.core.knobs import BUCKETING_MODES
from batchpilot.serving.errors import BadRequest, GatewayError, json_object

router = APIRouter(prefix="/admin")


def _require_token(request: Request) -> None:
    token = request.app.state.gateway.cfg.admin_token
    if not token:
        raise GatewayError("admin_disabled", "the admin API is off: export BATCHPILOT_ADMIN_TOKEN or set serve.admin_token_file",
                           status=403)
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise GatewayError("unauthorized", "missing or wrong bearer token", status=401)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ReloadBody(_Body):
    #: Exported policy folder; None = the one loaded now (or the shipped one).
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    #: 0 = load now; > 0 = canary on that share of traffic; None = the configured share.
    canary_share: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)

    @field_validator("path")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and not v.isprintable():
            raise ValueError("must not contain control characters (newlines, tabs, ...)")
        return v

    @field_validator("canary_share", mode="before")
    @classmethod
    def _int_is_a_share(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class ModeBody(_Body):
    mode: Literal["policy", "pid", "static", "shadow"]


class KnobsBody(_Body):
    batch_cap: int | None = Field(default=None, ge=1)
    bucketing: str | None = None

    @field_validator("bucketing")
    @classmethod
    def _known_mode(cls, v: str | None) -> str | None:
        if v is not None and v not in BUCKETING_MODES:
            raise ValueError(f"must be one of {BUCKETING_MODES}")
        return v


class FreezeBody(_Body):
    frozen: bool = True
    knobs: KnobsBody | None = None
    #: Set the knobs at once, past the shield's step limit (logged, counted, in status).
    force: bool = False


class KvDtypeBody(_Body):
    dtype: str = Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    #: Switch past the shield's gate and the quality guard (logged, counted, in status).
    force: bool = False


B = TypeVar("B", bound=_Body)


#: The largest admin body (the largest real one is a few hundred bytes).
MAX_ADMIN_BODY_BYTES = 64 * 1024


async def _bounded_body(request: Request) -> bytes:
    """The body, refused with 413 past ``MAX_ADMIN_BODY_BYTES`` (before reading it when its
    length is declared)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_ADMIN_BODY_BYTES:
        raise GatewayError("body_too_large", f"an admin body may have at most {MAX_ADMIN_BODY_BYTES} bytes",
                           status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_ADMIN_BODY_BYTES:
            raise GatewayError("body_too_large", f"an admin body may have at most {MAX_ADMIN_BODY_BYTES} bytes",
                               status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(request: Request, model: type[B]) -> B:
    """The request body as ``model``; a 400 naming each wrong field otherwise (not UTF-8, not
    JSON, ``NaN``/``Infinity``, unknown keys: ``json_object`` and ``_Body``)."""
    raw = await _bounded_body(request)
    data = json_object(raw) if raw else {}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise BadRequest("invalid_field", problems) from None


@router.get("/status", dependencies=[Depends(_require_token)])
async def status(request: Request) -> dict[str, Any]:
    gw = request.app.state.gateway
    q = gw.quality
    return {
        "control": gw.control.status(),
        "quality_guard": {"output_diff_rate": q.diff_rate, "samples": q.num_samples, "blocks_8bit": q.blocks_8bit},
        "upstreams": {ln.name: {"url": ln.upstream.url, "restarts": ln.upstream.num_restarts,
                                "pid": ln.upstream.managed.pid if ln.upstream.managed else None}
                      for ln in gw.lanes},
        "engine_log_dir": str(gw.log_dir) if gw.log_dir else None,
        "fail_open": gw.bypass_admission,
    }


@router.get("/decisions", dependencies=[Depends(_require_token)])
async def decisions(request: Request) -> dict[str, Any]:
    """The control loop's kept decisions after tick ``?since=N`` (``serve.control.history_len``)."""
    raw = request.query_params.get("since", "0")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise BadRequest("invalid_field", f"since: must be a tick number (a non-negative integer), got {raw[:40]!r}")
    loop = request.app.state.gateway.control
    return {"ticks": loop.num_ticks, "decisions": loop.decisions(int(raw))}


@router.post("/policy/reload", dependencies=[Depends(_require_token)])
async def reload_policy(request: Request) -> dict[str, Any]:
    """Body: ``{"path": folder (optional), "canary_share": 0..1 (optional; 0 = load now)}``.
    A policy that fails to load is a 400 and the running one stays."""
    body = await _body(request, ReloadBody)
    try:
        return request.app.state.gateway.control.policies.reload_policy(body.path, body.canary_share)
    except ValueError as exc:
        raise BadRequest("policy_load_failed", str(exc)) from None


@router.post("/mode", dependencies=[Depends(_require_token)])
async def set_mode(request: Request) -> dict[str, Any]:
    """Body: ``{"mode": "policy" | "pid" | "static" | "shadow"}``."""
    body = await _body(request, ModeBody)
    pm = request.app.state.gateway.control.policies
    pm.set_mode(body.mode)
    return {"mode": pm.mode, "acting": pm.acting(), "fallback_reason": pm.fallback_reason}


@router.post("/freeze", dependencies=[Depends(_require_token)])
async def freeze(request: Request) -> dict[str, Any]:
    """Body: ``{"frozen": bool, "knobs": {"batch_cap": n, "bucketing": mode} (optional),
    "force": bool}``. Knobs are a target walked to within the shield's limits; ``force`` sets
    them at once. Checked whole first: a refused call neither freezes nor changes a knob."""
    body = await _body(request, FreezeBody)
    knobs = body.knobs.model_dump(exclude_none=True) if body.knobs else None
    try:
        request.app.state.gateway.control.freeze(body.frozen, knobs, force=body.force)
    except ValueError as exc:
        raise BadRequest("invalid_field", str(exc)) from None
    return {"frozen": body.frozen}


@router.post("/kv_dtype", dependencies=[Depends(_require_token)])
async def set_kv_dtype(request: Request) -> dict[str, Any]:
    """Body: ``{"dtype": "auto" | "fp8" | ..., "force": bool}``. An operator's KV dtype switch:
    managed upstreams restart one at a time (drained first, queued requests wait); unmanaged
    ones only get it recommended. It passes the shield's gate (dwell, memory, gain) and the
    quality guard unless ``force``; a dtype the engine cannot run is refused always."""
    body = await _body(request, KvDtypeBody)
    try:
        return request.app.state.gateway.control.force_kv_dtype(body.dtype, force=body.force)
    except ValueError as exc:
        raise BadRequest("invalid_field", str(exc)) from None


class ResetBody(_Body):
    #: Required: a reset lifts the breaker, an override of the shield's state.
    force: bool = False


@router.post("/reset", dependencies=[Depends(_require_token)])
async def reset_control(request: Request) -> dict[str, Any]:
    """Body: ``{"force": true}``. Control state back to start-up (breaker, controllers'
    memory, telemetry windows); knobs, mode and policy stay. Logged, counted, in status."""
    body = await _body(request, ResetBody)
    if not body.force:
        raise BadRequest("force_required", "a reset lifts the breaker: send {\"force\": true} to mean it")
    request.app.state.gateway.control.reset_state()
    return {"ok": True}


class EmptyBody(_Body):
    """A route that takes no fields: any field, and a body that is not JSON, is a 400."""


@router.post("/quality/reset", dependencies=[Depends(_require_token)])
async def quality_reset(request: Request) -> dict[str, Any]:
    """Body: none or ``{}``. The quality guard's samples and verdict back to start."""
    await _body(request, EmptyBody)  # checked before anything changes, as on every admin route
    request.app.state.gateway.quality.reset()
    return {"ok": True}


