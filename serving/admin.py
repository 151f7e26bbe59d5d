"""The admin API (``/admin/*``): policy reload / canary, mode switch, freeze knobs, status.

Behind a bearer token (``serve.admin_token`` or ``$BATCHPILOT_ADMIN_TOKEN``); without a
configured token the admin API is off (403). Policies are loaded by ``PolicyRuntime`` from
safetensors + JSON: nothing is ever unpickled.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request

from batchpilot.serving.lanes import BadRequest, GatewayError

router = APIRouter(prefix="/admin")


def _require_token(request: Request) -> None:
    token = request.app.state.gateway.cfg.admin_token
    if not token:
        raise GatewayError("admin_disabled", "the admin API is off: set serve.admin_token or $BATCHPILOT_ADMIN_TOKEN",
                           status=403)
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise GatewayError("unauthorized", "missing or wrong bearer token", status=401)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    import json

    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest("invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("invalid_body", "request body must be a JSON object")
    return body


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
    }


@router.post("/policy/reload", dependencies=[Depends(_require_token)])
async def reload_policy(request: Request) -> dict[str, Any]:
    """Body: ``{"path": folder (optional), "canary_share": 0..1 (optional; 0 = load now)}``."""
    body = await _json(request)
    share = body.get("canary_share")
    if share is not None and not (isinstance(share, (int, float)) and 0 <= share <= 1):
        raise BadRequest("invalid_field", f"canary_share must be in [0, 1], got {share!r}")
    return request.app.state.gateway.control.reload_policy(body.get("path"), share)


@router.post("/mode", dependencies=[Depends(_require_token)])
async def set_mode(request: Request) -> dict[str, Any]:
    """Body: ``{"mode": "policy" | "pid" | "static" | "shadow"}``."""
    body = await _json(request)
    ctl = request.app.state.gateway.control
    try:
        ctl.set_mode(str(body.get("mode")))
    except ValueError as exc:
        raise BadRequest("invalid_field", str(exc)) from None
    return {"mode": ctl.mode, "acting": ctl.acting(), "fallback_reason": ctl.fallback_reason}


@router.post("/freeze", dependencies=[Depends(_require_token)])
async def freeze(request: Request) -> dict[str, Any]:
    """Body: ``{"frozen": bool, "knobs": {"batch_cap": n, "bucketing": mode} (optional)}``."""
    body = await _json(request)
    frozen = body.get("frozen", True)
    if not isinstance(frozen, bool):
        raise BadRequest("invalid_field", f"frozen must be true or false, got {frozen!r}")
    try:
        request.app.state.gateway.control.freeze(frozen, body.get("knobs"))
    except (ValueError, TypeError) as exc:
        raise BadRequest("invalid_field", str(exc)) from None
    return {"frozen": frozen}


@router.post("/kv_dtype", dependencies=[Depends(_require_token)])
async def set_kv_dtype(request: Request) -> dict[str, Any]:
    """Body: ``{"dtype": "auto" | "fp8" | ...}``. An operator's KV dtype switch: managed
    upstreams restart one at a time (drained first, queued requests wait); unmanaged ones only
    get it recommended. Bypasses the shield's dwell time, not the runnable-dtype check."""
    body = await _json(request)
    try:
        return request.app.state.gateway.control.force_kv_dtype(str(body.get("dtype")))
    except ValueError as exc:
        raise BadRequest("invalid_field", str(exc)) from None


@router.post("/quality/reset", dependencies=[Depends(_require_token)])
async def quality_reset(request: Request) -> dict[str, Any]:
    request.app.state.gateway.quality.reset()
    return {"ok": True}
