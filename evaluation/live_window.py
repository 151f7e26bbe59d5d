"""The trace window a live scenario replays: the file it names, the requests read from it as
vLLM's benchmark client will replay them, the window sized to this machine, and its label.

Shared by the live evaluation (``evaluation/live.py``), which replays it, and its simulated twin
(``evaluation/live_twin.py``), which replays the same requests on the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchpilot.config import REPO_ROOT
from batchpilot.envs.timed_trace import TimedTraceFile, TimedTraceOptions, convert_trace
from batchpilot.envs.traces import TraceOptions


def resolve_trace_path(trace: str) -> Path:
    """``live_scenario.trace`` as a file: a relative path from the current folder first (what
    a user typing ``live_scenario.trace=my.csv`` means), else from the repository root (the
    shipped scenarios name ``data/traces/...``); the not-found error names both places."""
    path = Path(trace).expanduser()
    if path.is_absolute():
        return path
    here, repo = Path.cwd() / path, REPO_ROOT / path
    for p in (here, repo):
        if p.is_file():
            return p.resolve()
    if here.resolve() == repo.resolve():
        raise FileNotFoundError(f"trace file not found: {here}")
    raise FileNotFoundError(f"trace file not found: {trace} (tried {here} and {repo})")


def scenario_trace(scenario: DictConfig) -> TimedTraceFile:
    """The scenario's window, read as the client will replay it."""
    s = scenario
    path = resolve_trace_path(str(s.trace))
    topts = TraceOptions(time_scale=float(s.time_scale), start_s=float(s.start_s),
                         duration_s=None if s.duration_s is None else float(s.duration_s),
                         max_model_len=int(s.max_model_len), overflow="clip",
                         spread_quantum_s=None if s.spread_quantum_s is None else float(s.spread_quantum_s))
    opts = TimedTraceOptions(trace=topts, max_prompt_len=s.max_prompt_len, max_output_len=s.max_output_len,
                             max_requests=s.max_requests, chunk_tokens=int(s.chunk_tokens))
    return convert_trace(path, str(s.format), opts)


def sized_window(scenario: DictConfig, tf: TimedTraceFile, rate: float) -> tuple[dict[str, Any], TimedTraceFile]:
    """The scenario's trace replayed at ``rate`` (req/s) for as long as written: the trace runs
    faster by rate / written rate and the window (trace seconds) grows by as much, so a faster
    machine gets more requests, not a shorter run (a 1 s control loop needs the seconds); a
    last exact stretch makes the mean rate ``rate``. Returns the scenario as replayed (its
    ``time_scale`` and ``duration_s``) and the window."""
    speed = rate / tf.rate
    sc = OmegaConf.to_container(scenario, resolve=True)
    assert isinstance(sc, dict)
    sc["time_scale"] = float(sc["time_scale"]) * speed
    if sc["duration_s"] is not None:
        sc["duration_s"] = float(sc["duration_s"]) * speed
    window = scenario_trace(OmegaConf.create(sc))
    fine = window.rate / rate
    sc["time_scale"] /= fine
    return sc, window.time_stretched(fine)


def scenario_label(scenario: Mapping[str, Any], tf: TimedTraceFile) -> str:
    """The scenario's name and the window its rows came from: the trace file, the trace seconds
    and the speed (as replayed: a sized scenario's, see ``sized_window``), and a count cut, e.g.
    ``steady (azure_llm_2023_conv.csv, trace s 0-60, x1)``. A name alone said ``steady`` for
    whatever trace and window a run put under it."""
    start = float(scenario.get("start_s") or 0.0)
    dur = scenario.get("duration_s")
    end = f"{start + float(dur):.4g}" if dur is not None else "end"
    parts = [Path(str(tf.source or scenario.get("trace"))).name, f"trace s {start:.4g}-{end}",
             f"x{float(scenario.get('time_scale') or 1.0):.3g}"]
    n = scenario.get("max_requests")
    if n is not None and len(tf) >= int(n):
        parts.append(f"first {int(n)} requests")
    return f"{scenario.get('name', 'scenario')} ({', '.join(parts)})"


__all__ = ["resolve_trace_path", "scenario_label", "scenario_trace", "sized_window"]
