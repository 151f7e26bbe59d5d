"""Request bodies: parsed, checked and reduced to what the gateway reads, and where that work
runs. A small body is inspected on the event loop. A large one goes to a worker process: the JSON
parse runs in C and holds the GIL, so in a worker thread it still stopped the loop, 0.25 s for
600,000 chat messages (7 MiB) on a quiet machine and over a second on a busy one, and every
other client's request waited. The body cap (``serve.max_body_bytes``) bounds the work."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import signal
import stat
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from batchpilot.serving.errors import BadRequest, GatewayError, json_object
from batchpilot.serving.tokens import PromptText, prompt_text

log = logging.getLogger(__name__)

#: Bodies above this are parsed and inspected off the event loop (``BodyInspector``), so the
#: loop keeps serving others; below it the work takes well under a millisecond.
OFF_LOOP_BYTES = 256 * 1024
#: Bodies opening more JSON arrays/objects than this are parsed off the loop whatever their
#: size: 250 KB of ``[],[],...`` took 40 ms to parse on a busy machine.
OFF_LOOP_CONTAINERS = 4096
#: The body keys the gateway reads (the body itself is forwarded as the client's bytes).
KEPT_KEYS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "n", "best_of",
             "priority")
#: Top-level fields of vLLM's completion, chat, tokenize and detokenize requests (0.32's
#: ``CompletionRequest``, ``ChatCompletionRequest``, ``Tokenize*Request``, ``DetokenizeRequest``,
#: names and aliases) and OpenAI's that vLLM ignores. vLLM takes any other field and ignores it
#: (``extra="allow"``, logged at debug level); the gateway lets such a field through too (clients
#: send ``metadata``, ``store``, ...) but only up to ``serve.max_unknown_field_bytes`` of JSON.
KNOWN_FIELDS = frozenset((
    "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "chat_template",
    "chat_template_kwargs", "continue_final_message", "documents", "ec_transfer_params", "echo",
    "frequency_penalty", "ignore_eos", "include_reasoning", "include_stop_str_in_output", "kv_transfer_params",
    "length_penalty", "logit_bias", "logprob_token_ids", "logprobs", "max_completion_tokens", "max_tokens",
    "media_io_kwargs", "messages", "min_p", "min_tokens", "mm_payload", "mm_processor_kwargs", "model", "n",
    "parallel_tool_calls", "presence_penalty", "priority", "prompt", "prompt_embeds", "prompt_logprobs",
    "reasoning_effort", "repetition_detection", "repetition_penalty", "request_id", "response_format",
    "return_mm_kwargs", "return_prompt_text", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "routed_experts_prompt_start", "seed", "session_id", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_token_ids", "stream", "stream_interval", "stream_options",
    "structured_outputs", "suffix", "temperature", "thinking_token_budget", "tool_choice", "tools", "top_k",
    "top_logprobs", "top_p", "truncate_prompt_tokens", "truncation_side", "use_beam_search", "user", "vllm_xargs",
    "watermarking", "best_of", "tokens", "return_token_strs",
))
#: What each route's body is: a generation request, or vLLM's /tokenize or /detokenize.
ROUTES = ("generate", "tokenize", "detokenize")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Bounds on what the gateway parses and forwards besides the body's size
    (``serve.max_json_containers``, ``serve.max_unknown_field_bytes``; the gateway passes the
    configured ones). None: unbounded."""

    max_containers: int | None = None
    max_unknown_field_bytes: int | None = None


def check_containers(raw: bytes, limits: BodyLimits) -> int:
    """Refuse a body that opens more JSON arrays/objects than ``limits`` allow, before parsing
    it: counting two bytes costs milliseconds for 8 MiB, the parse of millions of containers
    most of a second (``[``/``{`` inside strings count too: an upper bound)."""
    n = raw.count(b"[") + raw.count(b"{")
    if limits.max_containers is not None and n > limits.max_containers:
        raise BadRequest("too_many_json_values", f"the request body opens {n} or more JSON arrays/objects; the limit "
                         f"is serve.max_json_containers={limits.max_containers}")
    return n


def _json_size_over(value: Any, limit: int) -> bool:
    """Whether ``value`` takes more than ``limit`` bytes as JSON (about: strings count their
    characters, scalars a few bytes); stops as soon as it knows, so the walk costs at most
    ``limit`` steps."""
    size, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            size += len(v) + 3
        elif isinstance(v, dict):
            size += 2 + 2 * len(v)
            for k, x in v.items():
                size += len(k) + 3
                stack.append(x)
        elif isinstance(v, list):
            size += 2 + len(v)
            stack.extend(v)
        else:
            size += 5
        if size > limit:
            return True
    return False


def check_unknown_fields(body: dict[str, Any], raw_len: int, limits: BodyLimits) -> None:
    """A 400 for a top-level field vLLM does not know holding more than
    ``limits.max_unknown_field_bytes`` of JSON (vLLM would parse it, then ignore it)."""
    if limits.max_unknown_field_bytes is None or raw_len <= limits.max_unknown_field_bytes:
        return  # unbounded, or no field can be larger than the body
    for key in body.keys() - KNOWN_FIELDS:
        if _json_size_over(body[key], limits.max_unknown_field_bytes):
            raise BadRequest("unknown_field_too_large", f"field {str(key)[:60]!r} is not one vLLM reads and holds more "
                             f"than serve.max_unknown_field_bytes={limits.max_unknown_field_bytes} bytes of JSON; "
                             "remove it", param=str(key)[:60])


@dataclass(slots=True)
class Parsed:
    """A request body after ``inspect_body``: valid, with what the proxy needs from it."""

    #: The keys of ``KEPT_KEYS`` the client sent (not the whole body).
    body: dict[str, Any]
    seqs: int
    text: PromptText
    #: The body as UTF-8 JSON (the client's bytes unless it sent UTF-16/32), and where its
    #: opening brace is (after JSON whitespace).
    raw: bytes
    brace: int
    #: Whether the prompt is chat messages (a /tokenize body says so by having ``messages``).
    chat: bool = False


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a large body is parsed (process-wide; the
    last one out turns it back on). Parsing 8 MiB of ``[[],[],...]`` allocates millions of
    containers, each allocation burst triggered a collection of the whole heap, and the parse,
    in C, holds the GIL all along: the loop stood still for 0.75 s on a quiet machine and 5 s
    inside a gateway process on a busy one. JSON holds no reference cycles, and what the
    gateway keeps of a body is small (``KEPT_KEYS``, bounded lists)."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def inspect_body(raw: bytes, chat: bool, max_num_seqs: int, max_prompt_tokens: int,
                 limits: BodyLimits = BodyLimits(), route: str = "generate") -> Parsed:
    """Parse and validate ``raw``, count its sequences and collect its prompt (pure: safe in a
    worker thread). Only the keys the gateway reads are kept; the rest of the parsed body, and
    a refused body, are freed here, not on the loop. ``route``: a generation body, or one of
    vLLM's /tokenize (``chat`` is then whether it has ``messages``) or /detokenize."""
    containers = check_containers(raw, limits)
    with _gc_paused() if len(raw) > OFF_LOOP_BYTES or containers > OFF_LOOP_CONTAINERS else nullcontext():
        body = json_object(raw)
        err: GatewayError | None = None
        try:
            check_unknown_fields(body, len(raw), limits)
            if route != "generate":
                kept, seqs = _forwarded_prompt(body, route, max_prompt_tokens), 1
                chat = "messages" in kept
                text = prompt_text(kept, chat) if kept else PromptText([], 0, 0, 0)
            else:
                _validate(body, chat, max_num_seqs, max_prompt_tokens)
                seqs = num_sequences(body, chat)
                if seqs > max_num_seqs:
                    raise BadRequest("too_many_sequences", f"the request runs {seqs} sequences (n/best_of x "
                                     f"prompts); the engine runs at most max_num_seqs={max_num_seqs} at once")
                kept = {k: body[k] for k in KEPT_KEYS if k in body}
                text = prompt_text(kept, chat)
        except GatewayError as exc:
            err = exc.with_traceback(None)  # the traceback's frames would keep the body alive
        del body
        if err is not None:
            raise err
    enc = json.detect_encoding(raw)
    if enc != "utf-8":  # UTF-16/32 or a UTF-8 byte order mark: json.loads takes them; vLLM gets UTF-8
        raw = raw.decode(enc, "surrogatepass").encode("utf-8", "surrogatepass")
    return Parsed(kept, seqs, text, raw, len(raw) - len(raw.lstrip(b" \t\r\n")), chat)


def _validate(body: dict[str, Any], chat: bool, max_num_seqs: int, max_prompt_tokens: int) -> None:
    """A body's fields, checked. A list longer than anything the gateway lets through is
    refused by its length before its items are looked at (a list of millions must cost nothing
    but its parse): prompts of a batch run a sequence each (``max_num_seqs``); a token id, and
    a chat message, is at least one token of the prompt (``max_prompt_tokens``, the longest
    ``max_model_len`` of the upstreams)."""
    field_ = "messages" if chat else "prompt"
    if field_ not in body:
        raise BadRequest("missing_field", f"missing required field {field_!r}")
    v = body[field_]
    if isinstance(v, list) and len(v) > max_prompt_tokens and (chat or isinstance(v[0], int)):
        what = "messages" if chat else "token ids"
        raise BadRequest("prompt_too_long", f"the prompt has {len(v)} {what}, so at least {len(v)} tokens, more than "
                         f"the model's max_model_len={max_prompt_tokens}")
    if chat:
        if not isinstance(v, list) or not v or not all(isinstance(m, dict) and "role" in m for m in v):
            raise BadRequest("invalid_field", "'messages' must be a non-empty list of {role, content} objects")
    else:
        if isinstance(v, list) and len(v) > max_num_seqs and isinstance(v[0], (str, list)):
            raise BadRequest("too_many_sequences", f"the request has {len(v)} prompts; the engine runs at most "
                             f"max_num_seqs={max_num_seqs} sequences at once")
        if isinstance(v, list) and v and isinstance(v[0], list):  # a batch of token-id prompts
            if not all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in v):
                raise BadRequest("invalid_field", "'prompt' as a batch of token ids must be a list of non-empty "
                                 "lists of integers")
            longest = max(len(x) for x in v)
            if longest > max_prompt_tokens:
                raise BadRequest("prompt_too_long", f"a prompt has {longest} token ids, more than the model's "
                                 f"max_model_len={max_prompt_tokens}")
        elif not (isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, (str, int)) for x in v))):
            raise BadRequest("invalid_field", "'prompt' must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists")
    # vLLM reads the body leniently (pydantic): a null is an unset field, 8.0 and "8" are 8,
    # "true" is true. The gateway reads the same values the same way (and forwards the bytes).
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of"):
        body[key] = _lenient_int(key, body.get(key))
    body["stream"] = _lenient_bool("stream", body.get("stream"))
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of", "stream"):
        if body[key] is None:
            del body[key]
    scoring = not chat and _lenient_bool("echo", body.get("echo")) is True  # max_tokens 0: the prompt's logprobs
    for key in ("max_tokens", "max_completion_tokens"):
        n = body.get(key)
        if n is not None and n < (0 if scoring else 1):
            raise BadRequest("invalid_field", f"'{key}' must be at least {0 if scoring else 1}, got {n}", param=key)
    for key in ("n", "best_of"):
        n = body.get(key)
        if n is not None and n < 1:
            raise BadRequest("invalid_field", f"'{key}' must be an integer >= 1, got {n!r}", param=key)


def _forwarded_prompt(body: dict[str, Any], route: str, max_tokens: int) -> dict[str, Any]:
    """What of a /tokenize or /detokenize body the gateway counts: its prompt (``{"prompt"}``
    or ``{"messages"}``), or nothing to count. Only lengths are refused here: a list longer
    than the model's length (each item is at least a token); a wrong type is left to vLLM, so
    its own error answer comes back as it is."""
    key = "tokens" if route == "detokenize" else ("messages" if "messages" in body else "prompt")
    v = body.get(key)
    if isinstance(v, list) and len(v) > max_tokens:
        raise BadRequest("prompt_too_long", f"'{key}' has {len(v)} items, so at least {len(v)} tokens, more than "
                         f"the model's max_model_len={max_tokens}", param=key)
    if route == "detokenize":
        return {}  # its length is bounded above; vLLM checks the ids
    if key == "messages":
        return {"messages": v} if isinstance(v, list) and v and all(isinstance(m, dict) for m in v) else {}
    if isinstance(v, str) or (isinstance(v, list) and v and all(_is_int(x) for x in v)):
        return {"prompt": v}
    return {}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_TRUE = frozenset(("true", "1", "yes", "on", "t", "y"))
_FALSE = frozenset(("false", "0", "no", "off", "f", "n"))


def _lenient_int(key: str, v: Any) -> int | None:
    """An integer field as pydantic's lax mode reads it (what vLLM accepts), else a 400."""
    if v is None or _is_int(v):
        return v
    if isinstance(v, bool):  # pydantic's lax mode: true is 1, false is 0
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
        try:  # "8.0" is 8 too ("8.5" is refused, as there)
            f = float(v.strip())
        except ValueError:
            pass
        else:
            if f.is_integer():
                return int(f)
    raise BadRequest("invalid_field", f"'{key}' must be an integer, got {v!r}", param=key)


def _lenient_bool(key: str, v: Any) -> bool | None:
    """A boolean field as pydantic's lax mode reads it, else a 400."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):  # 0, 1, 0.0 and 1.0, as there
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise BadRequest("invalid_field", f"'{key}' must be true or false, got {v!r}", param=key)


def num_sequences(body: dict[str, Any], chat: bool) -> int:
    """Sequences one request runs in the engine: ``max(n, best_of)`` per prompt, times the
    prompts of a batch (a list of strings). Admission counts these against the batch cap: a
    request with ``n=8`` took one slot and ran eight."""
    per_prompt = max(int(body.get("n") or 1), int(body.get("best_of") or 1))
    prompts = 1
    if not chat:
        p = body["prompt"]
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            prompts = len(p)
    return per_prompt * prompts


def with_field(raw: bytes, brace: int, key: str, value: Any) -> bytes:
    """``raw`` (a JSON object whose opening brace is at ``brace``, without ``key``) with
    ``"key": value`` spliced in after the brace: one copy of the bytes and the rest passed on
    as the client wrote it, instead of encoding the whole body again on the event loop. The
    brace stays where it was, so fields can be added one after another."""
    return b"".join((raw[: brace + 1], json.dumps(key).encode(), b": ", json.dumps(value).encode(), b", ",
                     memoryview(raw)[brace + 1 :]))


def with_model(parsed: Parsed, model: str) -> bytes:
    """The body with ``"model": model`` added (it has no ``model`` key)."""
    return with_field(parsed.raw, parsed.brace, "model", model)


def forwarded_priority(body: dict[str, Any], priority: int, trusted: bool, key_header: str) -> int | None:
    """The ``priority`` to add to a forwarded body for an engine on ``--scheduling-policy
    priority`` (``serve.forward_priority``): the request's class ``priority``, or None when the
    client set the field itself (kept). A client's value must be an integer, and one smaller
    (more important) than its class needs a trusted key (403), as the priority header does.
    The value is read as vLLM reads it (pydantic's lax mode: ``"2"``, ``2.0``, ``true``)."""
    if "priority" not in body:
        return priority
    own = _lenient_int("priority", body["priority"])
    if own is None:
        raise BadRequest("invalid_field", "'priority' must be an integer, got None", param="priority")
    if own < priority and not trusted:
        raise GatewayError("priority_not_allowed", f"'priority': {own} is more important than the request's class "
                           f"({priority}); it needs a trusted key in header {key_header}", status=403,
                           param="priority")
    return None


def _worker_init(parent: int) -> None:
    """Run in each worker, which a fork made a copy of the gateway:

    - its signals back to their defaults: the gateway's handlers only set a flag the worker
      never reads, so SIGTERM did not end it; Ctrl-C is for the gateway, which shuts the pool
      down;
    - the gateway's sockets closed: a worker forked again after one died would otherwise hold
      the clients' connections, the listening socket and the upstream connections open after
      the gateway closed them (the pool talks over pipes, not sockets);
    - an end when the gateway has gone, however it went: a forked worker holds the write end of
      its own task pipe, so it never sees the pipe close, and workers of a gateway that was
      killed were left waiting for tasks forever."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _close_sockets()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _close_sockets() -> None:
    """Close every socket this process holds (Linux: the descriptors in /proc/self/fd)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)


def _inspect_in_worker(raw: bytes, chat: bool, max_num_seqs: int, max_prompt_tokens: int, limits: BodyLimits,
                       route: str) -> Parsed | GatewayError:
    """``inspect_body`` in the worker process; a refusal comes back as a value (an exception
    raised there would come back with the worker's traceback attached). The client's bytes are
    not sent back when they are the body as it goes upstream (``raw`` empty): the gateway has them."""
    try:
        parsed = inspect_body(raw, chat, max_num_seqs, max_prompt_tokens, limits, route)
    except GatewayError as exc:
        return exc
    if parsed.raw is raw:
        parsed.raw = b""
    return parsed


class BodyInspector:
    """Inspects request bodies (``inspect_body``): on the loop when small, in a pool of
    ``workers`` processes when large (``workers=0``, or before ``start``: a worker thread).

    The workers are forked, at the gateway's start (before most of its threads): a spawned
    worker imports the program's entry script again, which fails when there is none to import
    (a program read from stdin) and cost 1.5 s and 70 MB for ``scripts/serve.py``. A worker only
    parses JSON, so the locks of other threads that a fork copies are never taken in it. A
    worker that dies (killed, out of memory) costs the requests it held nothing but time: they
    are inspected again in a thread and the pool is started again."""

    def __init__(self, max_num_seqs: int, workers: int = 1, limits: BodyLimits = BodyLimits()) -> None:
        self.max_num_seqs = max_num_seqs
        self.workers = workers
        self.limits = limits
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Fork the worker processes now (milliseconds: the gateway's memory is shared until
        written) rather than at the first large body."""
        if self.workers > 0 and self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_worker_init, initargs=(os.getpid(),))
            self._pool.submit(int)  # the pool forks its workers at its first task

    def close(self, wait: bool = False) -> None:
        """Shut the pool down; ``wait``: until its workers and manager thread have ended (the
        gateway's stop: a pool still shutting down as the interpreter exits races CPython's own
        exit hook, which then printed "Exception ignored ... Bad file descriptor")."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None

    async def inspect(self, raw: bytes, chat: bool, max_prompt_tokens: int, route: str = "generate") -> Parsed:
        if len(raw) <= OFF_LOOP_BYTES and raw.count(b"[") + raw.count(b"{") <= OFF_LOOP_CONTAINERS:
            return inspect_body(raw, chat, self.max_num_seqs, max_prompt_tokens, self.limits, route)
        pool = self._pool
        if pool is not None:
            loop = asyncio.get_running_loop()
            try:
                out = await loop.run_in_executor(pool, _inspect_in_worker, raw, chat, self.max_num_seqs,
                                                 max_prompt_tokens, self.limits, route)
            except BrokenProcessPool:
                log.warning("a body-inspection worker died; starting the pool again")
                if self._pool is pool:
                    self.close()
                    self.start()
            else:
                if isinstance(out, GatewayError):
                    raise out
                if not out.raw:
                    out.raw = raw
                return out
        return await asyncio.to_thread(inspect_body, raw, chat, self.max_num_seqs, max_prompt_tokens, self.limits,
                                       route)
