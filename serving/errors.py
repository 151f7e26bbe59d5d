"""What the gateway answers itself: its errors (turned into JSON ``{"error": {...}}`` with a
status and a reason in one place, ``gateway._error_response``) and the one JSON body reader
every route uses, so a malformed body is a 400 with a reason on every route, never a 500."""

from __future__ import annotations

import json
from typing import Any


class GatewayError(Exception):
    """A request the gateway answers itself; ``status``/``reason``/``retry_after`` go to the
    client (mapped to HTTP in one place, ``gateway._error_response``)."""

    status = 500

    def __init__(self, reason: str, message: str, *, status: int | None = None, retry_after: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        #: The body field at fault, as vLLM's (and OpenAI's) errors name it.
        self.param = param
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a body refused in the inspection worker process comes back as one).
        return type(self), (self.reason, self.message), self.__dict__


class BadRequest(GatewayError):
    status = 400


class Refused(GatewayError):
    """Load-related refusals: 429 (queue full, shed) or 503 (timeout, upstream down)."""

    status = 503


class ClientGone(Exception):
    """The client disconnected; nothing is sent back. ``counted``: already counted as a
    rejection (it left a queue), so not again as "client_gone"."""

    def __init__(self, counted: bool = False) -> None:
        super().__init__("client disconnected")
        self.counted = counted


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; ``BadRequest`` saying what is wrong otherwise: not UTF-8, not
    JSON (``NaN``/``Infinity`` are not JSON either), nested too deep for the parser (10,000
    brackets raised RecursionError, a 500), or not an object."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except UnicodeDecodeError as exc:
        raise BadRequest("invalid_json", f"request body is not UTF-8 text: {exc}") from None
    except RecursionError:
        raise BadRequest("invalid_json", "request body is nested too deeply") from None
    except ValueError as exc:
        raise BadRequest("invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("invalid_body", "request body must be a JSON object")
    return body


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
