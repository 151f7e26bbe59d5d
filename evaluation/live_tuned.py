"""The ``vllm_tuned`` path of the live evaluation (issue 53): vLLM with its own limits, as an
operator would deploy it instead of batchpilot, not vLLM as shipped.

A second managed ``vllm serve`` (the gateway's own launcher, ``ManagedVLLM``: the same command,
environment and process-group handling as the gateway's engine) runs beside the gateway's,
idle while the other paths run. Its flags are vLLM's (``conf/live_evaluate.yaml``
``vllm_tuned``): ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--max-num-active-seqs``
(the running batch), ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` (its API server
answers 503 once the waiting requests / prompt tokens reach them). They are either given
(``vllm_tuned.flags``) or swept as vLLM's ``benchmarks/auto_tune`` and ``vllm bench sweep
serve_sla`` do: vLLM restarted per setting, a tuning window of the scenario's trace (disjoint from
the scored one) replayed by the same client at the same rate, the best goodput whose SLO
attainment reaches the floor kept. A queued-tokens value ``slo`` is vLLM's docs' sizing rule:
the TTFT objective x the prefill throughput measured here.

This module holds what can be decided without vLLM (the grid, the windows, the choice) and the
engine's start and stop; ``evaluation/live_probes.py`` runs the sweep's replays (``tune_flags``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

#: The path's name in ``paths``.
TUNED = "vllm_tuned"
#: vLLM's arguments a setting may hold (underscored names, as in vLLM's SchedulerConfig) and
#: the least value each takes (``vllm/config/scheduler.py``: ge=1 for the sequence counts and the
#: token budget, ge=0 for the queue limits).
FLAGS: dict[str, tuple[str, int]] = {
    "max_num_seqs": ("--max-num-seqs", 1),
    "max_num_batched_tokens": ("--max-num-batched-tokens", 1),
    "max_num_active_seqs": ("--max-num-active-seqs", 1),
    "max_num_queued_reqs": ("--max-num-queued-reqs", 0),
    "max_num_queued_tokens": ("--max-num-queued-tokens", 0),
}
#: A ``max_num_queued_tokens`` value meaning: the TTFT objective x the measured prefill throughput.
SLO_VALUE = "slo"

Setting = dict[str, Any]


class TunedConfigError(ValueError):
    """A ``vllm_tuned`` setting, grid or window that cannot run, said in one line."""


# --- settings ---------------------------------------------------------------------------------
def check_setting(setting: Mapping[str, Any], where: str) -> Setting:
    """One setting as vLLM takes it, its null values dropped (the flag not given). ``where``
    names it in the error (``vllm_tuned.flags``, ``vllm_tuned.grid``)."""
    out: Setting = {}
    for key, value in setting.items():
        if key not in FLAGS:
            raise TunedConfigError(f"{where}: {key!r} is not one of vLLM's limits the path sets; known: {list(FLAGS)}")
        if value is None:
            continue
        if value == SLO_VALUE and key == "max_num_queued_tokens":
            out[key] = value
            continue
        least = FLAGS[key][1]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            also = f" or {SLO_VALUE!r}" if key == "max_num_queued_tokens" else ""
            raise TunedConfigError(f"{where}: {key}={value!r} must be an integer >= {least}{also}, or null")
        out[key] = value
    seqs, active = out.get("max_num_seqs"), out.get("max_num_active_seqs")
    if seqs is not None and active is not None and active > seqs:  # vLLM refuses it at start-up
        raise TunedConfigError(f"{where}: max_num_active_seqs={active} > max_num_seqs={seqs} (vLLM refuses it)")
    return {k: out[k] for k in FLAGS if k in out}


def sweep_grid(grid: Mapping[str, Sequence[Any]], max_settings: int) -> list[Setting]:
    """Every combination of the grid's values, checked, duplicates (after nulls drop) once:
    the settings the sweep restarts vLLM for, in grid order. More than ``max_settings`` is an
    error (each setting costs a restart and a replay)."""
    if not grid:
        raise TunedConfigError("vllm_tuned.grid is empty: give values to sweep, or fixed vllm_tuned.flags")
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
            raise TunedConfigError(f"vllm_tuned.grid.{key}: a non-empty list of values is needed, got {values!r}")
    keys = list(grid)
    settings: list[Setting] = []
    for combo in itertools.product(*(list(grid[k]) for k in keys)):
        s = check_setting(dict(zip(keys, combo)), "vllm_tuned.grid")
        if s not in settings:
            settings.append(s)
    if len(settings) > max_settings:
        sizes = " x ".join(str(len(grid[k])) for k in keys)
        raise TunedConfigError(f"vllm_tuned.grid has {len(settings)} settings ({sizes}), more than "
                               f"vllm_tuned.max_settings={max_settings} (each is a vLLM restart and a replay): "
                               f"shrink the grid, or give vllm_tuned.flags")
    return settings


def plan_settings(node: Mapping[str, Any]) -> tuple[list[Setting], bool]:
    """The settings the path will try (one when ``flags`` are given) and whether they were given."""
    if any(v is not None for v in (node.get("flags") or {}).values()):
        return [check_setting(node["flags"], "vllm_tuned.flags")], True
    return sweep_grid(node["grid"], int(node["max_settings"])), False


def needs_prefill_probe(settings: Sequence[Mapping[str, Any]]) -> bool:
    return any(v == SLO_VALUE for s in settings for v in s.values())


def resolve_setting(setting: Mapping[str, Any], ttft_ms: float | None, prefill_tok_s: float | None) -> dict[str, int]:
    """``slo`` replaced by the TTFT objective x the prefill throughput (tokens)."""
    out: dict[str, int] = {}
    for k, v in setting.items():
        if v == SLO_VALUE:
            if not ttft_ms or not prefill_tok_s or not math.isfinite(prefill_tok_s):
                raise TunedConfigError(f"vllm_tuned: {k}={SLO_VALUE!r} needs slo.ttft_ms and a measured prefill "
                                       f"throughput (got ttft_ms={ttft_ms}, prefill {prefill_tok_s} tok/s)")
            out[k] = max(1, round(ttft_ms / 1e3 * prefill_tok_s))
        else:
            out[k] = int(v)
    return out


def setting_label(setting: Mapping[str, Any]) -> str:
    """``--max-num-seqs 8 --max-num-queued-tokens 2048``; ``vLLM's defaults`` for none."""
    return " ".join(f"{FLAGS[k][0]} {v}" for k, v in setting.items()) or "vLLM's defaults"


def engine_args(resolved: Mapping[str, int]) -> list[str]:
    """The setting as ``vllm serve`` arguments."""
    return [a for k, v in resolved.items() for a in (FLAGS[k][0], str(v))]


# --- windows ----------------------------------------------------------------------------------
def _extent(sc: Mapping[str, Any]) -> tuple[float, float]:
    start = float(sc.get("start_s") or 0.0)
    d = sc.get("duration_s")
    return start, math.inf if d is None else start + float(d)


def check_disjoint(scored: Mapping[str, Any], tuning: Mapping[str, Any], when: str) -> None:
    """The tuning window may share no trace second with the scored one: flags tuned on the
    requests they are scored on would flatter the path. ``when``: as written / as replayed."""
    (a0, a1), (b0, b1) = _extent(scored), _extent(tuning)
    if a0 < b1 and b0 < a1:
        raise TunedConfigError(
            f"vllm_tuned.tuning: the tuning window (trace s {b0:g}-{b1:g}) overlaps the scored window "
            f"(trace s {a0:g}-{a1:g}, {when}); the flags must be tuned on other requests than those scored: "
            f"set vllm_tuned.tuning.start_s >= {a1:g} (or null: right after the scored window)"
            + (f", or end it by {a0:g}" if a0 > 0 else ""))


def tuning_scenario(scenario: Mapping[str, Any], tuning: Mapping[str, Any],
                    replayed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The scenario the sweep replays: the scenario with the tuning window's ``start_s`` and
    ``duration_s`` (trace seconds, at the written ``time_scale``; a sized scenario's tuning
    window is sized to the scored one's rate after). ``replayed``: the scored window as replayed
    (a sized scenario's, grown), where a null ``start_s`` begins; as written if None."""
    scored = replayed if replayed is not None else scenario
    start = tuning.get("start_s")
    if start is None:
        end = _extent(scored)[1]
        if not math.isfinite(end):
            raise TunedConfigError("vllm_tuned.tuning.start_s=null starts right after the scored window, but it runs "
                                   "to the trace's end (live_scenario.duration_s=null): give start_s before it")
        start = end
    dur = tuning.get("duration_s")
    if dur is None:
        dur = scenario.get("duration_s")
        if dur is None:
            raise TunedConfigError("vllm_tuned.tuning.duration_s=null takes the scored window's length, which is "
                                   "open (live_scenario.duration_s=null): give it")
    if not (math.isfinite(float(dur)) and float(dur) > 0) or float(start) < 0:
        raise TunedConfigError(f"vllm_tuned.tuning: start_s={start} must be >= 0 and duration_s={dur} > 0")
    out = {**scenario, "start_s": float(start), "duration_s": float(dur)}
    check_disjoint(scored, out, "as written" if replayed is None else "as replayed")
    return out


# --- the choice -------------------------------------------------------------------------------
def choose(points: Sequence[Mapping[str, Any]], floor: float) -> dict[str, Any]:
    """The sweep's pick: the best goodput among the points whose SLO attainment reaches
    ``floor``; none reaching it, the best goodput of all, marked ``met_floor: false``."""
    if not points:
        raise TunedConfigError("vllm_tuned: the sweep has no point to choose from")

    def good(p: Mapping[str, Any]) -> float:
        g = float(p.get("request_goodput") or math.nan)
        return g if math.isfinite(g) else -math.inf

    ok = [p for p in points if float(p.get("slo_attainment") or 0.0) >= floor]
    best = max(ok or points, key=good)
    return {**best, "met_floor": bool(ok)}


# --- the engine -------------------------------------------------------------------------------
def base_engine_settings(overrides: Sequence[Any]) -> dict[str, int | None]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` the gateway's engine gets (its serve
    config, with any ``serve.*`` of ``gateway.overrides``), which the tuned engine keeps where a
    setting does not set them: both engines differ only by the setting."""
    from omegaconf import OmegaConf

    from batchpilot.config import CONF_DIR

    serve = OmegaConf.load(CONF_DIR / "serve" / "default.yaml")
    out: dict[str, int | None] = {"max_num_seqs": int(serve.max_num_seqs),
                                  "max_num_batched_tokens": serve.get("max_num_batched_tokens")}
    for o in map(str, overrides):
        key, _, value = o.partition("=")
        name = key.strip().lstrip("+").removeprefix("serve.")
        if name in out and value.strip():
            out[name] = None if value.strip() == "null" else int(value.strip())
    return out


@contextlib.contextmanager
def tuned_engine(model_dir: Path, served_name: str, max_model_len: int, kv_cache_space_gib: int,
                 vllm_args: Sequence[str], resolved: Mapping[str, int], base: Mapping[str, int | None],
                 log_dir: Path, timeout_s: float, alive_check: Callable[[], str | None] | None = None,
                 ) -> Iterator[tuple[str, Path]]:
    """A ``vllm serve`` with the setting ``resolved`` (the gateway's launcher: same command and
    environment as its engine), until ``/health`` answers; yields its URL and log; stopped (its
    process group) on exit. A start that fails or times out is a ``RuntimeError`` naming the
    setting and the log's error line."""
    from batchpilot.serving.upstream import ManagedVLLM, cpu_core_groups, free_port, last_error_line

    port = free_port()
    log_path = log_dir / f"vllm_tuned-{port}.log"
    rest = {k: v for k, v in resolved.items() if k not in ("max_num_seqs", "max_num_batched_tokens")}
    eng = ManagedVLLM(str(model_dir), port, served_model_name=served_name, max_model_len=max_model_len,
                      max_num_seqs=int(resolved.get("max_num_seqs", base["max_num_seqs"] or 256)),
                      max_num_batched_tokens=resolved.get("max_num_batched_tokens", base["max_num_batched_tokens"]),
                      kv_cache_space_gib=kv_cache_space_gib, extra_args=[*vllm_args, *engine_args(rest)],
                      log_path=log_path, cpu_cores=cpu_core_groups(1)[0])
    label = setting_label(resolved)
    try:
        eng.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if not eng.alive():
                why = last_error_line(log_path) or "no error line"
                raise RuntimeError(f"vllm_tuned ({label}): vllm serve exited during start-up: {why} (log: {log_path})")
            if alive_check is not None and (why := alive_check()) is not None:
                raise RuntimeError(f"vllm_tuned ({label}): {why}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{eng.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm_tuned ({label}): /health not 200 after {timeout_s:g} s "
                                   f"(gateway.startup_timeout_s; log: {log_path})")
            time.sleep(0.5)
        yield eng.url, log_path
    finally:
        eng.close()


__all__ = [
    "FLAGS", "SLO_VALUE", "TUNED", "TunedConfigError", "base_engine_settings", "check_disjoint", "check_setting",
    "choose", "engine_args", "needs_prefill_probe", "plan_settings", "resolve_setting", "setting_label", "sweep_grid",
    "tuned_engine", "tuning_scenario",
]
