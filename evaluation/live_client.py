"""One replay by vLLM's own benchmark client (``vllm.benchmarks.serve``, ``--dataset-name
timed_trace``) in this process: its arguments as ``vllm bench serve`` would build them, failed
requests' errors with the server's message, and the results row made from its result."""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Iterator

from batchpilot.envs.timed_trace import TimedTraceFile
from batchpilot.evaluation.live_errors import LiveEvaluationError

#: The start of a failed request's error for an HTTP refusal: vLLM's queue limits answer 503,
#: the gateway's breaker 429. Counted per row (``refused``), and misses like any failure.
REFUSAL_REASONS: tuple[str, ...] = ("Service Unavailable", "Too Many Requests")


def client_namespace(base_url: str, jsonl: Path, tf: TimedTraceFile, model_dir: Path, served_name: str,
                     goodput: Sequence[str], cfg_client: Mapping[str, Any], seed: int):
    """The argparse namespace ``vllm bench serve`` would build for this run."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", str(model_dir), "--served-model-name", served_name, "--tokenizer", str(model_dir),
        "--dataset-path", str(jsonl), *tf.client_args(), "--num-prompts", str(len(tf)),
        "--goodput", *goodput, "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--seed", str(seed), "--disable-tqdm", "--save-detailed",
    ]
    if cfg_client.get("temperature") is not None:
        argv += ["--temperature", str(cfg_client["temperature"])]
    for h in cfg_client.get("headers") or []:
        argv += ["--header", str(h)]
    if cfg_client.get("max_concurrency") is not None:
        argv += ["--max-concurrency", str(int(cfg_client["max_concurrency"]))]
    return parser.parse_args(argv)


def error_message(body: str) -> str:
    """The message of an HTTP error body: vLLM's and the gateway's JSON (``{"error": {"message":
    ...}}``, ``{"message": ...}``, ``{"detail": ...}``), else the text itself, on one line."""
    text = body.strip()
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict):
            err = data.get("error")
            for v in (err.get("message") if isinstance(err, dict) else err, data.get("message"), data.get("detail")):
                if v:
                    text = v if isinstance(v, str) else json.dumps(v)
                    break
    return " ".join(text.split())[:300]


class _ErrorBodies:
    """An aiohttp session for vLLM's request functions that keeps the body of a response that
    is not a 200: the client's functions record only the status's reason ("Bad Request") and
    drop the body, where vLLM (or the gateway) says why. Everything else is the session's."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.body: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def post(self, *args: Any, **kwargs: Any) -> Any:
        outer = self

        class _Ctx:
            async def __aenter__(self) -> Any:
                self.cm = outer._session.post(*args, **kwargs)
                self.resp = await self.cm.__aenter__()
                if self.resp.status != 200:
                    with contextlib.suppress(Exception):
                        outer.body = (await self.resp.read()).decode("utf-8", "replace")
                return self.resp

            async def __aexit__(self, *exc: Any) -> Any:
                return await self.cm.__aexit__(*exc)

        return _Ctx()


def with_error_bodies(request_func: Callable[..., Any]) -> Callable[..., Any]:
    """``request_func`` (one of vLLM's ``ASYNC_REQUEST_FUNCS``) whose failed outputs carry the
    response's message after the reason: ``Bad Request: This model's maximum context length is
    ...`` instead of ``Bad Request``."""
    if getattr(request_func, "_with_error_bodies", False):
        return request_func

    async def wrapped(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        s = _ErrorBodies(session)
        out = await request_func(request_func_input=request_func_input, session=s, pbar=pbar)
        if not out.success and s.body is not None and (msg := error_message(s.body)):
            out.error = f"{out.error}: {msg}" if out.error else msg
        return out

    wrapped._with_error_bodies = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def error_bodies_in_client(backend: str) -> Iterator[None]:
    """vLLM's benchmark client, while inside, with ``with_error_bodies`` on ``backend``'s request
    function (its table is read when a benchmark starts; put back after)."""
    from vllm.benchmarks.lib import endpoint_request_func as erf

    funcs = erf.ASYNC_REQUEST_FUNCS
    old = funcs.get(backend)
    if old is None:
        yield
        return
    funcs[backend] = with_error_bodies(old)
    try:
        yield
    finally:
        funcs[backend] = old


def run_client(args: Any, log_file: Path) -> dict[str, Any]:
    """``vllm.benchmarks.serve.main`` in this process, its printout to ``log_file``; a failed
    request's error carries the server's message (``with_error_bodies``). The client's own
    start-up check (one request; it raises when that fails) is a ``LiveEvaluationError`` naming
    the log."""
    from vllm.benchmarks.serve import main as bench_main

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), error_bodies_in_client(str(args.backend)):
            result = bench_main(args)
    except ValueError as e:
        if "Initial test run failed" not in str(e):
            raise
        raise LiveEvaluationError(f"vLLM's benchmark client: {' '.join(str(e).split())[:400]} "
                                  f"(client log: {log_file})") from None
    finally:
        log_file.write_text(buf.getvalue())
    return result


def row_from_result(result: Mapping[str, Any], *, scenario: str, path: str, rnd: int, position: int,
                    requests: int) -> dict[str, Any]:
    """One results row from the client's result dict."""
    completed, failed = int(result.get("completed", 0)), int(result.get("failed", 0))
    duration = float(result.get("duration") or math.nan)
    goodput = result.get("request_goodput")
    goodput = float(goodput) if goodput is not None else math.nan
    good = goodput * duration if math.isfinite(goodput * duration) else math.nan
    errors = [e for e in result.get("errors", []) if e]
    return {
        "scenario": scenario, "path": path, "round": rnd, "position": position, "requests": requests,
        "completed": completed, "failed": failed, "accounted": completed + failed == requests,
        # answered 503 (vLLM's queue limits) or 429 (the gateway's breaker): failed, so misses
        "refused": sum(1 for e in errors if str(e).startswith(REFUSAL_REASONS)),
        "request_goodput": goodput,
        "slo_attainment": round(good) / requests if requests and math.isfinite(good) else math.nan,
        "request_throughput": float(result.get("request_throughput", math.nan)),
        "output_throughput": float(result.get("output_throughput", math.nan)),
        "mean_ttft_ms": float(result.get("mean_ttft_ms", math.nan)),
        "p99_ttft_ms": float(result.get("p99_ttft_ms", math.nan)),
        "mean_tpot_ms": float(result.get("mean_tpot_ms", math.nan)),
        "p99_tpot_ms": float(result.get("p99_tpot_ms", math.nan)),
        "p99_e2el_ms": float(result.get("p99_e2el_ms", math.nan)),
        "duration_s": duration,
        "first_error": str(errors[0]).strip().splitlines()[-1][:300] if errors else "",
    }
