"""Live evaluation: a trace window replayed by vLLM's own benchmark client
(``vllm.benchmarks.serve``, ``--dataset-name timed_trace``) against a real ``vllm serve``,
straight and through the gateway under each controller, interleaved over rounds.

One managed gateway is started (``scripts/serve.py serve.managed=true``: the gateway and the
``vllm serve`` it owns, on the tiny model unless ``gateway.model`` says otherwise) and kept for
the whole run. Each round runs every path once, in an order that rotates between rounds so
that no path always runs first or last:

- ``vllm_direct``: the client at the ``vllm serve`` port itself (vLLM as shipped; the gateway
  is idle in ``static`` mode, its control loop still reads vLLM's /metrics once a second);
- ``vllm_tuned``: the client at a second managed ``vllm serve`` with vLLM's own limits
  (``--max-num-seqs``, ``--max-num-queued-tokens``, ...), swept on a tuning window of the
  trace disjoint from the scored one, or given (``evaluation/live_tuned.py``);
- ``static`` / ``pid`` / ``ppo``: the client at the gateway, whose controller is switched
  through its admin API (``/admin/mode``: static, pid, policy). Before each gateway path the
  knobs are reset at once to the start-up ones (``/admin/freeze`` with ``force``) and the KV
  dtype to the start-up one (``/admin/kv_dtype`` with ``force``, a managed restart), and the
  control state is reset (``/admin/reset``: breaker level, PID's integral, a policy's residual,
  the telemetry windows), so a path starts where the previous one started, not where it left the
  knobs or under its breaker and latency windows.

Every run replays the same window (same arrival times and lengths) with its own ``hash_ids``
salt, so no run hits the prompts another run left in vLLM's prefix cache. Between runs the
evaluation waits until vLLM has no request running or waiting (a condition, not a sleep).

Rows (one per round × path) carry the client's own metrics (goodput with ``--goodput
ttft:<slo> tpot:<slo>`` from ``conf/slo``), the accounting (requests = completed + failed), and
vLLM's preemptions, peak KV usage, iterations (and their mean tokens) and mean wait in its own
queue from its /metrics. Out: results.json, results.csv,
results.md (mean ± 95 % CI per path and the paired per-round difference to ``vllm_direct``),
goodput.png and per-run client logs under ``runs/``. The gateway is a process, reached over HTTP;
only vllm_tuned's engine is started with the gateway's own launcher (``ManagedVLLM``), so that it
differs from the gateway's engine by its flags alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
from omegaconf import DictConfig, OmegaConf

from batchpilot.config import CONF_DIR, REPO_ROOT
from batchpilot.core.telemetry import SLO
from batchpilot.envs.timed_trace import HASH_STRIDE, TimedTraceFile, write_timed_trace
from batchpilot.evaluation.live_metrics import (
    VllmSampler,
    engine_counters,
    engine_idle,
    engine_row_fields,
    gateway_counters,
)
from batchpilot.evaluation.live_results import BASELINE, PATHS, finite_or_none, write_results
from batchpilot.evaluation.live_tuned import (
    TUNED,
    TunedConfigError,
    base_engine_settings,
    check_disjoint,
    choose,
    needs_prefill_probe,
    plan_settings,
    resolve_setting,
    setting_label,
    tuned_engine,
    tuning_scenario,
)
from batchpilot.evaluation.live_window import scenario_label, scenario_trace, sized_window
from batchpilot.evaluation.plan import override_key
from batchpilot.nodes import from_node
from batchpilot.schemas import check_app
from batchpilot.schemas.live import LiveEvaluateApp, LiveScenarioConfig
from batchpilot.serving.upstream import free_port

log = logging.getLogger(__name__)

#: The gateway's control mode for each gateway path.
GATEWAY_MODE = {"static": "static", "pid": "pid", "ppo": "policy"}
#: Paths whose client talks to a vLLM itself (the gateway idle in ``static`` mode meanwhile):
#: vLLM as shipped, and vLLM with its own limits (``evaluation/live_tuned.py``, its own engine).
DIRECT_PATHS: tuple[str, ...] = (BASELINE, TUNED)
#: The start of a failed request's error for an HTTP refusal: vLLM's queue limits answer 503,
#: the gateway's breaker 429. Counted per row (``refused``), and misses like any failure.
REFUSAL_REASONS: tuple[str, ...] = ("Service Unavailable", "Too Many Requests")


class LiveEvaluationError(RuntimeError):
    """A configuration or start-up problem, said in one line."""


class LiveEvaluationInterrupted(KeyboardInterrupt):
    """Ctrl-C mid-run, after the gateway was stopped and the finished runs were written as
    partial results (results.json meta ``complete: false``); a ``KeyboardInterrupt`` still,
    so a caller that does not know it stops as before."""

    def __init__(self, done: int, total: int, out_dir: Path) -> None:
        super().__init__(f"interrupted after {done} of {total} runs; partial results in {out_dir}")
        self.done, self.total, self.out_dir = done, total, out_dir


# --- small helpers --------------------------------------------------------------------------
def log_tail(path: Path | None, n: int = 4, width: int = 200) -> str:
    """The last ``n`` non-blank lines of a log, on one line (each cut to ``width``), for an
    error that must say why without a traceback; '' when there is no such file."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln[:width] for ln in lines[-n:])


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.25,
               alive: Callable[[], str | None] | None = None, log: Path | None = None) -> None:
    """Poll ``cond`` until true; a ``LiveEvaluationError`` naming ``what`` (and the last lines
    of ``log``, the gateway's) after ``timeout_s``, so the script says it in one line. ``alive``
    returns a reason to give up early (a process that exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None and (why := alive()) is not None:
            raise LiveEvaluationError(_with_tail(f"while waiting for {what}: {why}", log))
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise LiveEvaluationError(_with_tail(f"{what}: not reached after {timeout_s:g} s", log))
        time.sleep(poll_s)


def engine_logs(folder: Path) -> list[Path]:
    """The managed vLLM's logs the gateway writes into ``folder`` (``serve.log_dir``: the run's
    ``out_dir``), one ``vllm-<port>.log`` per engine port."""
    return sorted(folder.glob("vllm-*.log"))


def _with_tail(msg: str, log: Path | None) -> str:
    tail = log_tail(log)
    if tail:
        msg = f"{msg}; last lines of {log}: {tail}"
    elif log is not None and log.is_file():
        msg = f"{msg}; see {log}"
    engines = engine_logs(log.parent) if log is not None else []
    return msg + (f"; vLLM's log: {', '.join(map(str, engines))}" if engines else "")


def schedule(paths: Sequence[str], rounds: int, order: str = "rotate", seed: int = 0) -> list[list[str]]:
    """Path order per round. ``rotate``: round r starts at path r (mod n), so over n rounds
    every path runs once in every position; ``shuffle``: a seeded random order per round;
    ``fixed``: the given order every round."""
    paths = list(paths)
    if rounds < 1 or not paths:
        raise LiveEvaluationError(f"need rounds >= 1 and at least one path, got rounds={rounds}, paths={paths}")
    if order == "fixed":
        return [list(paths) for _ in range(rounds)]
    if order == "rotate":
        n = len(paths)
        return [paths[r % n:] + paths[: r % n] for r in range(rounds)]
    if order == "shuffle":
        rng = random.Random(seed)
        out = []
        for _ in range(rounds):
            p = list(paths)
            rng.shuffle(p)
            out.append(p)
        return out
    raise LiveEvaluationError(f"order must be rotate, shuffle or fixed, got {order!r}")


# --- the gateway process --------------------------------------------------------------------
@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen
    token: str
    log_path: Path
    initial_knobs: dict[str, Any] = field(default_factory=dict)

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/status", headers=self._headers(), timeout=10)
        r.raise_for_status()
        return r.json()

    def admin(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/admin/{path}", json=dict(body), headers=self._headers(), timeout=30)
        if r.status_code != 200:
            raise LiveEvaluationError(f"gateway /admin/{path} {dict(body)} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def decisions(self, since: int) -> list[dict[str, Any]]:
        """The control loop's decisions after tick ``since`` (``GET /admin/decisions``)."""
        r = httpx.get(f"{self.url}/admin/decisions", params={"since": since}, headers=self._headers(), timeout=30)
        r.raise_for_status()
        return list(r.json()["decisions"])

    def lane(self) -> dict[str, Any]:
        lanes = self.status()["control"]["lanes"]
        if len(lanes) != 1:
            raise LiveEvaluationError(f"the live evaluation drives one upstream; the gateway has {len(lanes)}")
        return next(iter(lanes.values()))

    def upstream(self) -> dict[str, Any]:
        ups = self.status()["upstreams"]
        return next(iter(ups.values()))

    def exited(self) -> str | None:
        if self.proc.poll() is not None:  # (the error adds the log's last lines and vLLM's log)
            return f"the gateway exited with code {self.proc.returncode}"
        return None


@contextlib.contextmanager
def running_gateway(cfg: DictConfig, scenario: DictConfig, model_dir: Path, served_name: str,
                    log_path: Path) -> Iterator[GatewayProcess]:
    """``scripts/serve.py serve.managed=true`` on a free port, in its own process group; on
    exit SIGTERM, then SIGKILL, the gateway and the vLLM process group it owns. The gateway runs
    under ``batchpilot.serving.reaper`` (the group's leader), which ends the group when this
    process is gone however it ended (SIGKILL included), so no gateway or vLLM outlives it."""
    g = cfg.gateway
    port = free_port()
    folder = log_path.parent.resolve()  # absolute: the gateway runs in the repository
    token = secrets.token_hex(16)
    vllm_args = [*g.extra_vllm_args, *scenario.vllm_args]
    overrides = [
        "serve.managed=true", f"serve.port={port}", f"serve.model={model_dir}",
        f"serve.served_model_name={served_name}", f"serve.max_model_len={scenario.max_model_len}",
        f"serve.kv_cache_space_gib={g.kv_cache_space_gib}",
        "serve.extra_vllm_args=[" + ",".join(json.dumps(str(a)) for a in vllm_args) + "]",
        "serve.control.mode=static", f"slo.ttft_ms={cfg.slo.ttft_ms}", f"slo.tpot_ms={cfg.slo.tpot_ms}",
        # vLLM's logs beside gateway.log (the gateway's default is a /tmp folder nobody removes);
        # Hydra writes nothing there (no output subdir, no job log): its run dir is only made.
        f"serve.log_dir={folder}", f"hydra.run.dir={folder}", "hydra.output_subdir=null",
        "hydra/job_logging=none", "hydra/hydra_logging=none", *g.overrides,
    ]
    reaper = [sys.executable, "-m", "batchpilot.serving.reaper", str(os.getpid()), "--"]
    cmd = [*reaper, sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), *overrides]
    env = dict(os.environ, BATCHPILOT_ADMIN_TOKEN=token, VLLM_CPU_KVCACHE_SPACE=str(g.kv_cache_space_gib))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, process_group=0)
    gw = GatewayProcess(f"http://127.0.0.1:{port}", proc, token, log_path)
    pids: list[int] = []
    try:
        wait_until(lambda: httpx.get(f"{gw.url}/readyz", timeout=2).status_code == 200, g.startup_timeout_s,
                   "the gateway's /readyz (gateway.startup_timeout_s)", poll_s=0.5, alive=gw.exited, log=log_path)
        pid = gw.upstream().get("pid")
        pids = [pid] if pid else []
        gw.initial_knobs = dict(gw.lane()["knobs_in_force"])
        yield gw
    finally:
        with contextlib.suppress(Exception):
            pid = gw.upstream().get("pid")
            pids = [pid] if pid else pids
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in pids:  # the vLLM process group, if the gateway did not end it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def gateway_idle(gw: GatewayProcess) -> bool:
    lane = gw.lane()
    return lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0 and lane["healthy"] and not lane["restarting"]


def prepare_path(gw: GatewayProcess, path: str, timeout_s: float, policy_dir: str | None = None) -> None:
    """Put the gateway in the state a path starts from: start-up KV dtype and knobs, the
    path's controller (``static`` while ``vllm_direct`` runs) and fresh control state
    (``/admin/reset``: breaker, controllers' memory, telemetry windows). ``policy_dir``: a policy path's
    artifact, loaded into the gateway first (``/admin/policy/reload``, no canary)."""
    init = gw.initial_knobs
    if gw.lane()["knobs_in_force"].get("kv_dtype") != init.get("kv_dtype"):
        gw.admin("kv_dtype", {"dtype": init["kv_dtype"], "force": True})
        wait_until(lambda: gw.lane()["knobs_in_force"].get("kv_dtype") == init["kv_dtype"] and gateway_idle(gw),
                   timeout_s, f"the KV dtype back to {init['kv_dtype']}", alive=gw.exited, log=gw.log_path)
    gw.admin("mode", {"mode": "static"})
    gw.admin("freeze", {"frozen": False, "force": True,
                        "knobs": {"batch_cap": init["batch_cap"], "bucketing": init["bucketing"]}})
    if policy_dir is not None:
        gw.admin("policy/reload", {"path": policy_dir, "canary_share": 0.0})
    mode = "policy" if policy_dir is not None else GATEWAY_MODE.get(path, "static")
    out = gw.admin("mode", {"mode": mode})
    if mode == "policy" and out.get("acting") != "policy":
        raise LiveEvaluationError(f"the gateway would not run the policy (acting={out.get('acting')}, "
                                  f"fallback: {out.get('fallback_reason')})")
    # Not under the last run's breaker, PID integral or latency windows.
    gw.admin("reset", {"force": True})


# --- the client ------------------------------------------------------------------------------
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


# --- the evaluation --------------------------------------------------------------------------


def check_policy_dir(name: str, folder: str) -> None:
    """Load ``policies.NAME``'s folder with the gateway's torch-free loader (manifest, weights,
    features, action space); its reason, naming the folder, as a ``LiveEvaluationError``."""
    from batchpilot.policies.runtime import PolicyLoadError, PolicyRuntime

    try:
        PolicyRuntime.from_dir(folder)
    except (PolicyLoadError, OSError, ValueError) as e:
        raise LiveEvaluationError(f"policies.{name}: {e} (an exported policy folder is needed)") from None


def policy_dirs(cfg: DictConfig) -> dict[str, str]:
    """``policies``: more paths, each an exported policy the gateway runs in ``policy`` mode
    (e.g. ``{ppo_finetuned: outputs/finetune_live/run/policy}``); with any, ``ppo`` reloads the
    shipped policy before its runs. Folders are made absolute (the gateway runs elsewhere) and
    loaded here, as the gateway will load them, so a broken one fails before vLLM starts."""
    extra = {str(k): str(Path(str(v)).expanduser().resolve()) for k, v in cfg.policies.items()}
    clash = [k for k in extra if k in PATHS]
    if clash:
        raise LiveEvaluationError(f"policies may not redefine the built-in paths {clash}")
    for name, d in extra.items():
        check_policy_dir(name, d)
    if extra:
        from batchpilot.policies.ppo_controller import PRETRAINED_DIR

        extra = {"ppo": str(PRETRAINED_DIR), **extra}
    return extra


#: The gateway's settings the evaluation sets itself (``running_gateway``), and what to do instead.
OWNED_GATEWAY_KEYS: dict[str, str] = {
    "serve.managed": "drop it: the evaluation always runs a managed vLLM",
    "serve.port": "drop it: the evaluation picks a free port and waits on it",
    "serve.model": "set gateway.model instead",
    "serve.served_model_name": "set gateway.served_model_name instead",
    "serve.max_model_len": "set live_scenario.max_model_len instead",
    "serve.kv_cache_space_gib": "set gateway.kv_cache_space_gib instead",
    "serve.extra_vllm_args": "set gateway.extra_vllm_args or live_scenario.vllm_args instead",
    "serve.control.mode": "drop it: each path sets the gateway's mode (paths)",
    "serve.log_dir": "drop it: vLLM's logs are kept in out_dir, beside gateway.log",
    "slo.ttft_ms": "set live_evaluate's slo.ttft_ms instead (the client's goodput uses it too)",
    "slo.tpot_ms": "set live_evaluate's slo.tpot_ms instead (the client's goodput uses it too)",
}


def check_gateway_overrides(overrides: Sequence[Any]) -> None:
    """``gateway.overrides`` may not set what the evaluation sets itself: such an override
    would replace it silently (a ``serve.port`` one made the run wait out its whole start-up
    timeout on a port nothing listened on). A parent key (``serve=...``) counts too."""
    for o in map(str, overrides):
        key = override_key(o)
        hit = [k for k in OWNED_GATEWAY_KEYS if k == key or k.startswith(key + ".")]
        if hit:
            what = hit[0] if key == hit[0] else f"{key} (which holds {hit[0]})"
            raise LiveEvaluationError(f"gateway.overrides: {o!r} sets {what}, which the live evaluation sets "
                                      f"itself; {OWNED_GATEWAY_KEYS[hit[0]]}")


def check_sized_count(scenario: DictConfig) -> None:
    """``max_requests`` on a scenario sized to the machine (``load_multiple``) is refused: the
    sizing sets the rate (load_multiple x what vLLM serves here), so a fixed count of requests
    lasts count / rate seconds, under a second for a few dozen at the 30-75 req/s the sized
    scenarios reach here; the gateway's control loop (a tick a second) has nothing to act on,
    and the probe of so few requests at once is no saturated capacity either. A shorter sized
    run shortens the window instead (``duration_s``: the run lasts as long as written)."""
    n, m = scenario.get("max_requests"), scenario.get("load_multiple")
    if n is None or m is None:
        return
    name = scenario.get("name", "?")
    raise LiveEvaluationError(
        f"live_scenario.max_requests={n} on a scenario sized to the machine ({name!r}: load_multiple={m:g}): "
        f"the {n} requests would be replayed at {m:g} x what vLLM serves here, within {n} / ({m:g} x C) s "
        f"(C: the probe's req/s; {n / (m * 30):.2g} s at 30 req/s), too short for the gateway's control loop; "
        f"for a shorter sized run set live_scenario.duration_s (trace seconds, replayed for as long as written), "
        f"or live_scenario.load_multiple=null to replay the first {n} requests at the written rate")


def check_client(client: Mapping[str, Any]) -> None:
    """``client.headers`` and ``client.max_concurrency`` as vLLM's client takes them, checked
    before vLLM starts (its client raised only at the first run, minutes later)."""
    for h in client.get("headers") or []:
        key, eq, value = str(h).partition("=")
        if not eq or not key.strip():
            raise LiveEvaluationError(f"client.headers: {str(h)!r} is not KEY=VALUE")
        if key.strip().lower() == "x-priority":  # the twin reads it as the gateway does: an integer
            try:
                int(value.strip())
            except ValueError:
                raise LiveEvaluationError(f"client.headers: {str(h)!r}: x-priority must be an integer") from None
    mc = client.get("max_concurrency")
    if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 1):
        raise LiveEvaluationError(f"client.max_concurrency must be null (open loop) or an integer >= 1, got {mc!r}")


def _check(cfg: DictConfig) -> list[str]:
    """The run's paths. The keys and types were checked against ``schema/live_evaluate``
    (``batchpilot.schemas.live.LiveEvaluateApp``) at compose time; again here for a key added with
    ``+key=...``; then what a type cannot say (known, distinct paths; at least one round; the
    client's headers and concurrency; gateway overrides that would replace the evaluation's own)."""
    try:
        check_app(LiveEvaluateApp, cfg)
        from_node(LiveScenarioConfig, cfg.live_scenario)  # its values (a schema checks types only)
    except ValueError as e:
        raise LiveEvaluationError(str(e)) from None
    check_sized_count(cfg.live_scenario)
    paths = list(cfg.paths)
    known = (*PATHS, *policy_dirs(cfg))
    bad = [p for p in paths if p not in known]
    if bad or len(set(paths)) != len(paths):
        raise LiveEvaluationError(f"paths must be distinct names among {tuple(dict.fromkeys(known))}, got {paths}")
    if int(cfg.rounds) < 1:
        raise LiveEvaluationError(f"rounds must be >= 1, got {cfg.rounds}")
    check_client(cfg.client)
    check_gateway_overrides(cfg.gateway.overrides)
    if TUNED in paths:
        check_tuned(cfg)
    try:  # the client's --goodput and every controller's objectives
        SLO(ttft_ms=cfg.slo.get("ttft_ms"), tpot_ms=cfg.slo.get("tpot_ms"), e2el_ms=cfg.slo.get("e2el_ms"))
    except ValueError as e:
        raise LiveEvaluationError(str(e)) from None
    lat = float(cfg.twin_ingress_latency_s)
    if not 0 <= lat < math.inf:  # checked before the runs, not when the twin starts after them
        raise LiveEvaluationError(f"twin_ingress_latency_s must be a finite number of seconds >= 0, got {lat}")
    hw_dir = CONF_DIR / "hardware"
    if not (hw_dir / f"{cfg.twin_hardware}.yaml").is_file():
        known = sorted(p.stem for p in hw_dir.glob("*.yaml"))
        raise LiveEvaluationError(f"twin_hardware={cfg.twin_hardware!r} is not a profile in conf/hardware; known: {known}")
    return paths


def check_tuned(cfg: DictConfig) -> tuple[list[dict[str, Any]], bool, dict[str, Any] | None]:
    """``vllm_tuned``: its settings (the fixed ``flags``, or the sweep's grid, at most
    ``max_settings``), its floor, and for a sweep the tuning window as written (disjoint from
    the scored window). Returns (settings, given, the tuning scenario or None)."""
    node = cfg.vllm_tuned
    try:
        settings, given = plan_settings(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
        floor = float(node.attainment_floor)
        if not 0.0 <= floor <= 1.0:
            raise TunedConfigError(f"vllm_tuned.attainment_floor={floor} must be within 0 and 1")
        if int(node.prefill_probe_requests) < 1:
            raise TunedConfigError(f"vllm_tuned.prefill_probe_requests={node.prefill_probe_requests} must be >= 1")
        sc = OmegaConf.to_container(cfg.live_scenario, resolve=True)
        assert isinstance(sc, dict)
        tuning = (None if given and not needs_prefill_probe(settings)  # the window a sweep or a prefill probe reads
                  else tuning_scenario(sc, OmegaConf.to_container(node.tuning, resolve=True)))  # type: ignore[arg-type]
    except TunedConfigError as e:
        raise LiveEvaluationError(str(e)) from None
    return settings, given, tuning


def check_out_dir(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is not a folder (an existing file, or under one) and a folder
    that already holds a run: a rerun would overwrite results.* but leave the old run's
    ``runs/`` logs and twin.json beside them, two runs mixed in one folder. An existing folder
    without a run is fine (nothing is written to it before the checks pass)."""
    for p in (out_dir, *out_dir.parents):
        if p.exists():
            if not p.is_dir():
                raise LiveEvaluationError(f"out_dir {out_dir}: {p} is a file, not a folder; pick another out_dir")
            break
    runs = out_dir / "runs"
    held = [p.name for p in (out_dir / "results.json",) if p.exists()]
    if runs.is_dir() and any(runs.iterdir()):
        held.append("runs/")
    if held:
        raise LiveEvaluationError(f"out_dir {out_dir} already holds a run ({', '.join(held)}); pick a new out_dir "
                                  f"(twin_of={out_dir} recomputes only its simulated twin)")


def live_evaluate(cfg: DictConfig, model_dir: Path | None = None) -> dict[str, Any]:
    """Run the live evaluation ``cfg`` (conf/live_evaluate.yaml) and write its files."""
    paths = _check(cfg)
    check_out_dir(Path(str(cfg.out_dir)))
    speed = None
    if cfg.sim_twin and cfg.twin_speed_of:  # read before the runs: a bad folder fails now, not after them
        from batchpilot.evaluation.live_twin import speed_of

        try:
            speed = speed_of(cfg.twin_speed_of)
        except ValueError as e:
            raise LiveEvaluationError(str(e)) from None
    pdirs = policy_dirs(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin/metrics poll otherwise
    scenario = cfg.live_scenario
    try:  # the trace window, read before anything is written or started
        tf = scenario_trace(scenario)
    except (OSError, ValueError) as e:
        raise LiveEvaluationError(f"live_scenario {scenario.get('name', '?')!r}: {e}") from None
    tuned_plan = check_tuned(cfg) if TUNED in paths else None
    if tuned_plan is not None and tuned_plan[2] is not None:
        try:  # the tuning window as written: not empty (its overlap with the scored one is checked)
            scenario_trace(OmegaConf.create(tuned_plan[2]))
        except (OSError, ValueError) as e:
            raise LiveEvaluationError(f"vllm_tuned.tuning (trace s {tuned_plan[2]['start_s']:g}-"
                                      f"{tuned_plan[2]['start_s'] + tuned_plan[2]['duration_s']:g}): {e}") from None
    order = schedule(paths, int(cfg.rounds), str(cfg.order), int(cfg.seed))
    out_dir = Path(str(cfg.out_dir))
    runs_dir = out_dir / "runs"
    try:  # the first thing written: every check has passed
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LiveEvaluationError(f"out_dir {out_dir}: cannot create it: {e.strerror or e}") from None
    save_run_config(cfg, out_dir)
    log_handler = logging.FileHandler(out_dir / "live_evaluate.log")
    log_handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(log_handler)
    try:
        return _live_evaluate(cfg, out_dir, order, pdirs, speed, tf, model_dir, tuned_plan)
    finally:
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()


def save_run_config(cfg: DictConfig, out_dir: Path) -> None:
    """``out_dir/.hydra/config.yaml`` (the composed config, resolved: what ``twin_of`` reads) and,
    under Hydra, ``overrides.yaml``: what Hydra writes itself, written here only once the checks
    have passed, so a refused run leaves nothing behind (conf/live_evaluate.yaml has Hydra write
    nothing)."""
    d = out_dir / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, d / "config.yaml", resolve=True)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        OmegaConf.save(HydraConfig.get().overrides.task, d / "overrides.yaml")


class _RunDriver:
    """One run of vLLM's benchmark client at a time, on a path: its salted copy of the window,
    vLLM and the gateway idle and the gateway put in the path's state first, vLLM sampled and
    its counters read around it. The state every run shares (the salt, vllm_tuned's engine
    while one is up, the window as sized) lives here, so that the warm-up, the capacity probe,
    the tuning sweep and the rounds all run the same way."""

    def __init__(self, cfg: DictConfig, gw: GatewayProcess, vllm_url: str, tf: TimedTraceFile,
                 pdirs: Mapping[str, str], model_dir: Path, served: str, out_dir: Path) -> None:
        self.cfg, self.gw, self.vllm_url, self.pdirs = cfg, gw, vllm_url, pdirs
        #: The window as replayed now (the sizing replaces it): a run's client reads its summary.
        self.tf = tf
        self.model_dir, self.served, self.out_dir = model_dir, served, out_dir
        self.runs_dir = out_dir / "runs"
        self.goodput = [f"ttft:{cfg.slo.ttft_ms}", f"tpot:{cfg.slo.tpot_ms}"]
        client_cfg = OmegaConf.to_container(cfg.client, resolve=True)
        assert isinstance(client_cfg, dict)
        self.client_cfg: dict[str, Any] = client_cfg  # type: ignore[assignment]
        self.salt = 0
        self.tuned_url: str | None = None  # the vllm_tuned engine's URL while one runs

    def engine_url(self, path: str) -> str:
        """The vLLM a path's requests end in: vllm_tuned's own, else the gateway's."""
        if path == TUNED:
            if self.tuned_url is None:
                raise LiveEvaluationError("vllm_tuned: no tuned engine is running")
            return str(self.tuned_url)
        return self.vllm_url

    def all_idle(self) -> bool:
        return (engine_idle(self.vllm_url) and gateway_idle(self.gw)
                and (self.tuned_url is None or engine_idle(str(self.tuned_url))))

    def counters(self, path: str) -> dict[str, float]:
        """vLLM's counters, and the gateway's for a run through it (vLLM direct waits in none)."""
        c = engine_counters(self.engine_url(path))
        return c if path in DIRECT_PATHS else c | gateway_counters(self.gw.url)

    def run(self, path: str, records: Sequence[Mapping[str, Any]], name: str) -> tuple[dict[str, Any], dict]:
        """Replay ``records`` on ``path`` (files ``runs/<name>.*``); the client's result and the
        row's other figures (``extra``: vLLM sampled and counted, the gateway's decisions)."""
        cfg, gw, tf = self.cfg, self.gw, self.tf
        self.salt += 1
        jsonl = write_timed_trace([{**r, "hash_ids": [self.salt * HASH_STRIDE + h for h in r["hash_ids"]]}
                                   for r in records], self.runs_dir / f"{name}.jsonl")
        wait_until(self.all_idle, cfg.gateway.settle_timeout_s,
                   "vLLM and the gateway idle before a run (gateway.settle_timeout_s)", alive=gw.exited,
                   log=gw.log_path)
        prepare_path(gw, path, cfg.gateway.settle_timeout_s, self.pdirs.get(path))
        sub = TimedTraceFile(records=tuple(records), chunk_tokens=tf.chunk_tokens, source=tf.source,
                             clipped=tf.clipped, duration_s=tf.duration_s, summary=tf.summary)
        eng = self.engine_url(path)
        url = eng if path in DIRECT_PATHS else gw.url
        args = client_namespace(url, jsonl, sub, self.model_dir, self.served, self.goodput, self.client_cfg,
                                int(cfg.seed))
        restarts0 = gw.upstream().get("restarts", 0)
        counters0 = self.counters(path)
        tick0 = gw.status()["control"]["ticks"]
        t0 = time.monotonic()
        with VllmSampler(eng) as sampler:
            result = run_client(args, self.runs_dir / f"{name}.log")
        if sampler.problem():
            print(f"live_evaluate: {name}: {sampler.problem()}", flush=True)
        extra = {"wall_s": time.monotonic() - t0, "peak_kv_usage": sampler.peak_kv,
                 "peak_running": sampler.peak_running, "mean_running": sampler.mean_running,
                 "mean_batch_cap": math.nan}
        if path not in DIRECT_PATHS:  # what the control loop saw and set during the run, a line per tick
            decisions = gw.decisions(tick0)
            (self.runs_dir / f"{name}.decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
            if decisions:
                extra["mean_batch_cap"] = sum(d["batch_cap"] for d in decisions) / len(decisions)
        wait_until(lambda: engine_idle(eng), cfg.gateway.settle_timeout_s,
                   "vLLM idle after a run (gateway.settle_timeout_s)", alive=gw.exited, log=gw.log_path)
        extra.update(engine_row_fields(counters0, self.counters(path)))
        lane, ups = gw.lane(), gw.upstream()
        extra["acting"] = "vllm" if path in DIRECT_PATHS else gw.status()["control"].get("acting", "")
        extra["kv_dtype"] = lane["knobs_in_force"].get("kv_dtype", "")
        extra["engine_restarts"] = ups.get("restarts", 0) - restarts0
        return result, extra

    @contextlib.contextmanager
    def tuned_engine(self, resolved: Mapping[str, int]) -> Iterator[str]:
        """vllm_tuned's own engine with ``resolved``'s flags, the gateway's engine otherwise,
        while inside (``TUNED`` runs go to it)."""
        cfg, scenario = self.cfg, self.cfg.live_scenario
        with tuned_engine(self.model_dir, self.served, int(scenario.max_model_len),
                          int(cfg.gateway.kv_cache_space_gib), [*cfg.gateway.extra_vllm_args, *scenario.vllm_args],
                          resolved, base_engine_settings(cfg.gateway.overrides), self.out_dir,
                          float(cfg.gateway.startup_timeout_s), alive_check=self.gw.exited) as (url, _):
            self.tuned_url = url
            try:
                yield url
            finally:
                self.tuned_url = None

    def warm_up(self, paths: Sequence[str], records: Sequence[Mapping[str, Any]], name: str | None = None) -> None:
        """The first ``warmup.requests`` of ``records`` on each of ``paths`` (none when 0): a fresh
        vllm-cpu engine runs slower through its first minute."""
        nw = int(self.cfg.warmup.requests)
        if nw <= 0:
            return
        warm = records[:nw]
        for path in paths:
            t0 = time.monotonic()
            res, _ = self.run(path, warm, name or f"warmup_{path}")
            if name is None:
                print(f"live_evaluate: warm-up {path}: {res.get('completed')} of {len(warm)} completed "
                      f"in {time.monotonic() - t0:.0f} s", flush=True)
            else:
                print(f"live_evaluate: warm-up {name}: {res.get('completed')} of {len(warm)} completed", flush=True)

    def warm_tuned(self, records: Sequence[Mapping[str, Any]], name: str) -> None:
        """vllm_tuned's engine warmed up as the others were (``warm_up``)."""
        self.warm_up([TUNED], records, name)


@dataclass
class _Progress:
    """What the run has so far: its rows, and the window, load and vllm_tuned meta as they are
    now (the sizing and the sweep replace them), for results written after every run."""

    cfg: DictConfig
    out_dir: Path
    order: list[list[str]]
    pdirs: Mapping[str, str]
    tf: TimedTraceFile
    rows: list[dict[str, Any]] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)
    sized: dict[str, Any] | None = None
    tuned_meta: dict[str, Any] = field(default_factory=dict)

    def meta(self, interrupted: bool = False) -> dict[str, Any]:
        return _meta(self.cfg, self.tf, self.order, self.pdirs, self.load, done=len(self.rows),
                     interrupted=interrupted, tuned=self.tuned_meta)

    def write(self, plots: bool = False, interrupted: bool = False) -> dict[str, Path]:
        return write_results(self.rows, self.out_dir, meta=self.meta(interrupted=interrupted), plots=plots)


def _model_dir(cfg: DictConfig, model_dir: Path | None) -> Path:
    """The model the gateway's vLLM serves: the caller's, ``gateway.model``, else the tiny one."""
    if model_dir is not None:
        return model_dir
    if cfg.gateway.model:
        return Path(str(cfg.gateway.model))
    from batchpilot.platform.tiny_model import build_tiny_model

    return build_tiny_model()


def _live_evaluate(cfg: DictConfig, out_dir: Path, order: list[list[str]], pdirs: Mapping[str, str],
                   speed: Mapping[str, Any] | None, tf: TimedTraceFile, model_dir: Path | None,
                   tuned_plan: tuple[list[dict[str, Any]], bool, dict[str, Any] | None] | None = None,
                   ) -> dict[str, Any]:
    """The run itself, into ``out_dir`` (made), after ``live_evaluate``'s checks: the gateway
    up, the warm-up, the sizing, vllm_tuned's flags and engine, the rounds, then the twin."""
    scenario = cfg.live_scenario
    print(f"live_evaluate: scenario {scenario.name}: {tf.summary}", flush=True)
    model_dir = _model_dir(cfg, model_dir)
    served = str(cfg.gateway.served_model_name)
    t_start = time.monotonic()
    prog = _Progress(cfg, out_dir, order, pdirs, tf)
    with partial_on_interrupt(lambda: prog.write(interrupted=True), lambda: len(prog.rows),
                              sum(map(len, order)), out_dir), \
            running_gateway(cfg, scenario, model_dir, served, out_dir / "gateway.log") as gw, \
            contextlib.ExitStack() as engines:
        vllm_url = gw.upstream()["url"]
        print(f"live_evaluate: gateway {gw.url}, vLLM {vllm_url}, up after {time.monotonic() - t_start:.0f} s",
              flush=True)
        runner = _RunDriver(cfg, gw, vllm_url, tf, pdirs, model_dir, served, out_dir)
        runner.warm_up(("vllm_direct", "static"), tf.records)
        if scenario.load_multiple is not None:  # sized to this machine: a saturated probe first
            prog.load, prog.sized, prog.tf = machine_load(
                scenario, tf, lambda recs: runner.run(BASELINE, recs, "capacity_probe")[0])
            runner.tf = prog.tf
        if tuned_plan is not None:  # vllm_tuned: its flags (swept, or given), then its engine for the rounds
            _start_tuned(runner, prog, tuned_plan, engines)
        _run_rounds(runner, prog)
    files = prog.write(plots=bool(cfg.plots))
    if cfg.sim_twin:  # the same requests on the calibrated simulator (evaluation/live_twin.py)
        files["twin"] = _write_twin(cfg, prog, runner.client_cfg, speed)
    print(f"live_evaluate: {len(prog.rows)} runs in {time.monotonic() - t_start:.0f} s; files in {out_dir}",
          flush=True)
    print((out_dir / "results.md").read_text(), flush=True)
    return {"rows": prog.rows, "files": files, "trace": prog.tf}


def _start_tuned(runner: _RunDriver, prog: _Progress,
                 tuned_plan: tuple[list[dict[str, Any]], bool, dict[str, Any] | None],
                 engines: contextlib.ExitStack) -> None:
    """vllm_tuned's flags (the sweep's pick, or the given ones), then its engine up and warmed
    for the rounds, kept in ``engines`` until they end."""
    settings, given, tuning_sc = tuned_plan
    prog.tuned_meta, chosen = tune_flags(runner.cfg, settings, given, tuning_sc, prog.sized, prog.tf, runner.run,
                                         runner.tuned_engine, runner.warm_tuned)
    prog.write()
    try:
        engines.enter_context(runner.tuned_engine(chosen))
    except RuntimeError as e:
        raise LiveEvaluationError(str(e)) from None
    runner.warm_tuned(prog.tf.records, "warmup_vllm_tuned")


def _run_rounds(runner: _RunDriver, prog: _Progress) -> None:
    """Every round's paths in their order, a row each, the results rewritten after each run."""
    tf, scenario = prog.tf, runner.cfg.live_scenario
    label = scenario_label(prog.sized or OmegaConf.to_container(scenario, resolve=True), tf)
    for rnd, paths_r in enumerate(prog.order):
        for pos, path in enumerate(paths_r):
            res, extra = runner.run(path, tf.records, f"r{rnd}_{path}")
            row = row_from_result(res, scenario=label, path=path, rnd=rnd, position=pos,
                                  requests=len(tf))
            row.update(extra)
            prog.rows.append(row)
            print(f"live_evaluate: round {rnd} {path}: goodput {row['request_goodput']:.3f} req/s, "
                  f"{row['completed']}/{row['requests']} completed, {row['failed']} failed, "
                  f"preemptions {row['preemptions']:.0f}, wall {row['wall_s']:.0f} s", flush=True)
            prog.write()


def _write_twin(cfg: DictConfig, prog: _Progress, client_cfg: Mapping[str, Any],
                speed: Mapping[str, Any] | None) -> Path:
    """The runs' requests on the calibrated simulator, every path (vllm_tuned at the flags it ran
    with), into twin.json."""
    from batchpilot.evaluation.live_twin import header_priority, twin_of_rows, write_twin

    scenario, tf = cfg.live_scenario, prog.tf
    tuned_flags = (prog.tuned_meta.get("chosen") or {}).get("setting")
    sc = prog.sized or OmegaConf.to_container(scenario, resolve=True)  # the window the runs replayed
    assert isinstance(sc, dict)
    sc = {**sc, "trace": tf.source}  # the file read (the simulator resolves a relative one from the repo)
    twin, match = twin_of_rows(tf, sc, {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms}, prog.rows,
                               paths=[p for p in cfg.paths if p != TUNED or tuned_flags],
                               tuned_flags=tuned_flags, match=bool(cfg.twin_match),
                               match_gateway=bool(cfg.twin_match_gateway),
                               vllm_args=[*cfg.gateway.extra_vllm_args, *scenario.vllm_args],
                               priority=header_priority(client_cfg.get("headers"), 1), seed=int(cfg.seed),
                               policy_dirs={p: d for p, d in prog.pdirs.items() if p != "ppo"},
                               gateway_overrides=[str(o) for o in cfg.gateway.overrides],
                               speed=speed, ingress_latency_s=float(cfg.twin_ingress_latency_s),
                               hardware=str(cfg.twin_hardware))
    write_twin(prog.out_dir, twin, prog.rows, match=match, hardware=str(cfg.twin_hardware))
    return prog.out_dir / "twin.json"


@contextlib.contextmanager
def partial_on_interrupt(write: Callable[[], object], done: Callable[[], int], total: int,
                         out_dir: Path) -> Iterator[None]:
    """Ctrl-C inside: the finished runs written as partial results (``write``), then
    ``LiveEvaluationInterrupted``. Outside ``running_gateway``, so its cleanup has run first."""
    try:
        yield
    except KeyboardInterrupt:
        write()
        raise LiveEvaluationInterrupted(done(), total, out_dir) from None


def _meta(cfg: DictConfig, tf: TimedTraceFile, order: list[list[str]], pdirs: Mapping[str, str],
          load: Mapping[str, float], done: int = 0, interrupted: bool = False,
          tuned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """results.json's meta. ``complete``: every planned run is in (false while the run goes on,
    and in what an interrupted or killed run leaves). ``vllm_tuned``: its flags and the sweep."""
    total = sum(map(len, order))
    return {"complete": done == total and not interrupted, "runs_done": done, "runs_planned": total,
            "interrupted": interrupted,
            "scenario": OmegaConf.to_container(cfg.live_scenario, resolve=True), "trace": tf.summary,
            "requests_per_run": len(tf), "window_s": tf.duration_s, "order": order,
            "slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms},
            "warmup_requests": int(cfg.warmup.requests), "host_cpus": os.cpu_count(),
            "policies": dict(pdirs), "load": dict(load), **({"vllm_tuned": dict(tuned)} if tuned else {})}


def machine_load(scenario: DictConfig, tf: TimedTraceFile,
                 run: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]
                 ) -> tuple[dict[str, Any], dict[str, Any], TimedTraceFile]:
    """The load a sized scenario replays: ``load_multiple`` x what vLLM serves here, probed
    (``capacity_probe`` with ``run``) or given (``capacity_req_s``: another run's, so two runs
    replay the same requests at the same times). Returns (results.json's ``load``, the
    scenario as replayed, the window)."""
    given = scenario.get("capacity_req_s")
    if given is None:
        load: dict[str, Any] = capacity_probe(run, tf)
        how = (f"capacity probe: vLLM served the window's {load['probe_requests']:.0f} requests at "
               f"{load['capacity_req_s']:.2f} req/s (all sent at once)")
    else:
        load = {"capacity_req_s": float(given), "capacity_given": True, "written_rate_req_s": tf.rate,
                "written_duration_s": tf.duration_s}
        how = f"capacity given (live_scenario.capacity_req_s, not probed): {float(given):.2f} req/s"
    sized, tf = sized_window(scenario, tf, float(scenario.load_multiple) * load["capacity_req_s"])
    load.update(load_multiple=float(scenario.load_multiple), replayed_rate_req_s=tf.rate,
                requests=len(tf), time_scale=sized["time_scale"], window_trace_s=sized["duration_s"])
    print(f"live_evaluate: {how}; replaying {len(tf)} requests at {tf.rate:.2f} req/s = "
          f"{scenario.load_multiple} x that over {tf.duration_s:.1f} s (written: {load['written_rate_req_s']:.2f} "
          f"req/s; time_scale {sized['time_scale']:.3g})", flush=True)
    return load, sized, tf


#: A sweep point's figures kept in results.json (``meta.vllm_tuned.points``) and results.md.
SWEEP_KEYS: tuple[str, ...] = ("request_goodput", "slo_attainment", "completed", "failed", "refused",
                               "p99_ttft_ms", "p99_tpot_ms", "duration_s")


def prefill_throughput(run: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]],
                       records: Sequence[Mapping[str, Any]]) -> float:
    """vLLM's prefill throughput here (prompt tokens / s): ``records``' prompts sent at once
    with one output token each (``run``: straight to the gateway's vLLM), for a queued-tokens
    limit sized as vLLM's docs say (TTFT objective x prefill throughput)."""
    res = run([{**r, "timestamp": 0.0, "output_length": 1} for r in records])
    tok, dur = float(res.get("total_input_tokens") or 0.0), float(res.get("duration") or math.nan)
    if not (math.isfinite(dur) and dur > 0 and tok > 0) or int(res.get("completed") or 0) < len(records):
        raise LiveEvaluationError(f"vllm_tuned: the prefill probe completed {res.get('completed')} of {len(records)} "
                                  f"requests ({tok:.0f} prompt tokens in {dur} s); cannot size max_num_queued_tokens=slo")
    return tok / dur


def tune_flags(cfg: DictConfig, settings: Sequence[Mapping[str, Any]], given: bool,
               tuning_sc: Mapping[str, Any] | None, sized: Mapping[str, Any] | None, tf: TimedTraceFile,
               one_run: Callable[..., tuple[dict[str, Any], dict]],
               use_engine: Callable[[Mapping[str, int]], contextlib.AbstractContextManager[str]],
               warm: Callable[[Sequence[Mapping[str, Any]], str], None]) -> tuple[dict[str, Any], dict[str, int]]:
    """vllm_tuned's flags: the given ones, or the sweep's pick (``live_tuned.choose``) after
    vLLM was restarted with each setting (``use_engine``), warmed up and replayed the tuning
    window (a sized scenario's at the scored window's rate). Returns (results.json's
    ``meta.vllm_tuned``, the chosen setting)."""
    node = cfg.vllm_tuned
    meta: dict[str, Any] = {"given": given, "attainment_floor": float(node.attainment_floor),
                            "settings": [dict(s) for s in settings], "prefill_tok_s": None, "points": []}
    ttf = None
    if tuning_sc is not None:  # the tuning window, sized to the scored one's rate when that is sized
        try:
            tsc = dict(tuning_sc)
            if sized is not None:  # a null start_s begins after the scored window as replayed (grown)
                written = OmegaConf.to_container(cfg.live_scenario, resolve=True)
                tsc = tuning_scenario(written, OmegaConf.to_container(node.tuning, resolve=True), replayed=sized)  # type: ignore[arg-type]
            ttf = scenario_trace(OmegaConf.create(tsc))
            if sized is not None:
                tsc, ttf = sized_window(OmegaConf.create(tsc), ttf, tf.rate)
                check_disjoint(sized, tsc, "as replayed, both sized to this machine")
        except (TunedConfigError, OSError, ValueError) as e:
            raise LiveEvaluationError(f"vllm_tuned.tuning: {e}") from None
        meta.update(tuning_window=scenario_label(tsc, ttf), tuning_requests=len(ttf))
    if needs_prefill_probe(settings):
        assert ttf is not None  # check_tuned makes the tuning window for it
        recs = ttf.records[:int(node.prefill_probe_requests)]
        meta["prefill_tok_s"] = prefill_throughput(lambda r: one_run(BASELINE, r, "prefill_probe")[0], recs)
        print(f"live_evaluate: vllm_tuned: prefill throughput {meta['prefill_tok_s']:.0f} tokens/s "
              f"({len(recs)} tuning-window prompts at once)", flush=True)
    resolved = [resolve_setting(s, cfg.slo.get("ttft_ms"), meta["prefill_tok_s"]) for s in settings]
    if given:
        meta["chosen"] = {"setting": resolved[0], "flags": setting_label(resolved[0])}
        print(f"live_evaluate: vllm_tuned: flags given, no sweep: {setting_label(resolved[0])}", flush=True)
        return meta, resolved[0]
    assert ttf is not None
    for i, setting in enumerate(resolved):
        t0 = time.monotonic()
        try:
            with use_engine(setting):
                up_s = time.monotonic() - t0
                warm(ttf.records, f"sweep{i}_warmup")
                res, _ = one_run(TUNED, ttf.records, f"sweep{i}")
        except RuntimeError as e:  # a setting vLLM refuses to start with
            raise LiveEvaluationError(str(e)) from None
        row = row_from_result(res, scenario="tuning", path=TUNED, rnd=i, position=0, requests=len(ttf))
        point = {"setting": setting, "flags": setting_label(setting), "engine_start_s": up_s,
                 **{k: finite_or_none(row[k]) for k in SWEEP_KEYS}}
        meta["points"].append(point)
        print(f"live_evaluate: vllm_tuned sweep {i + 1}/{len(resolved)} ({point['flags']}): goodput "
              f"{row['request_goodput']:.3f} req/s, attainment {row['slo_attainment']:.3f}, "
              f"{row['refused']} refused of {len(ttf)}", flush=True)
    best = choose(meta["points"], float(node.attainment_floor))
    meta["chosen"] = {"setting": best["setting"], "flags": best["flags"], "met_floor": best["met_floor"],
                      "tuning_goodput": best["request_goodput"], "tuning_attainment": best["slo_attainment"]}
    print(f"live_evaluate: vllm_tuned: chose {best['flags']} (best of {len(resolved)} on the tuning window"
          f"{'' if best['met_floor'] else '; none reached the attainment floor'})", flush=True)
    return meta, dict(best["setting"])


def capacity_probe(run: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]],
                   tf: TimedTraceFile) -> dict[str, float]:
    """What vLLM serves on this machine for the window's own requests: all of them sent at
    once, straight to vLLM, the client's request throughput. The scenarios' written rates were
    sized on one machine; a faster one served ``mixed`` with every request inside the SLO
    (nothing to control), a slower one would drown every path."""
    res = run([{**r, "timestamp": 0.0} for r in tf.records])
    cap = float(res.get("request_throughput") or 0.0)
    if not (math.isfinite(cap) and cap > 0) or int(res.get("completed") or 0) < len(tf):
        raise LiveEvaluationError(f"capacity probe: vLLM completed {res.get('completed')} of {len(tf)} requests "
                                  f"({cap} req/s); cannot size the load (set live_scenario.load_multiple=null "
                                  f"to replay the written rate)")
    return {"capacity_req_s": cap, "probe_requests": float(len(tf)), "written_rate_req_s": tf.rate,
            "written_duration_s": tf.duration_s}


# --- results out -----------------------------------------------------------------------------


__all__ = [
    "DIRECT_PATHS", "GATEWAY_MODE", "LiveEvaluationError", "LiveEvaluationInterrupted", "check_tuned",
    "live_evaluate", "prefill_throughput", "row_from_result", "schedule", "tune_flags",
]
