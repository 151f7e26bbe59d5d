"""The simulated twin of a live evaluation: the same scenario on the calibrated simulator.

``scripts/live_evaluate.py`` replays a trace window with vLLM's benchmark client against vLLM
direct and through the gateway (static / pid / ppo). The twin replays **the same converted
requests** — the window's ``timed_trace`` records (same clipping of prompt and output lengths,
same timestamps, one ``hash_ids`` block per ``chunk_tokens`` and no prefix shared across
requests, as each live run's salted ids) — as a ``RequestStream`` on
``engine=sim model=tiny_llama hardware=cpu_tiny_served`` (the committed calibration profile
plus what ``vllm serve`` adds per decode step and running sequence on this machine,
``conf/hardware/cpu_tiny_served.yaml``: the live paths go through the API server, with
the live engine's scheduler: block size 32 unless the scenario's ``--block-size`` says
otherwise, token budget 2,048, 256 sequences, the scenario's ``--num-gpu-blocks-override`` as
``engine.num_gpu_blocks_override``, and the served round trip as ``engine.ingress_latency_s``:
a prompt the gateway admits when the last one's first token comes back reaches the engine an
iteration or more later, not in the very next one), under the same SLO, and on the same paths:

- ``vllm_direct`` ≙ the ``vllm_default`` controller as shipped (no shield, breaker or
  batchpilot admission; ``policy_overrides.vllm_default.as_shipped``);
- ``vllm_tuned`` ≙ the server the live run started with vLLM's own flags (its sweep's pick or
  the given ones, ``meta.vllm_tuned.chosen``): vLLM alone with those flags and its API server's
  503s (``envs/server_env.py``), as the matrix's ``vllm_tuned`` runs a grid point; not swept again;
- ``static`` / ``pid`` / ``ppo``: the controllers behind the shield, started from the
  gateway's start-up knobs (the ``control`` group both compose: batch cap 64, FIFO) with the
  gateway's breaker (``shield.breaker_shrink`` 0.8, ``conf/serve_app.yaml``); requests carry the
  gateway's default priority (1, sheddable) unless the live client sent ``x-priority``.

After the window every path's controller and shield keep acting until the last request is
answered (``env.drain_controlled``), as the gateway's loop runs on while the client waits.

The simulator is deterministic, so one episode per path. Goodput is ``summarize``'s (good
requests / run duration, as the client's ``--goodput``).

``ranking`` compares the order of the paths by goodput in the twin with the order live (issue 53:
the simulator must rank as the engine does) and names each pair that flips, and whether the live
difference of that pair is clear of its paired interval.

``survival`` turns a simulated gain and the live paired gain into the share that survives
live, and says "no simulated gain to survive" instead of dividing by ~0.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from batchpilot.config import REPO_ROOT
from batchpilot.envs.timed_trace import TimedTraceFile
from batchpilot.envs.workloads import RequestStream
from batchpilot.evaluation.live_window import scenario_trace, sized_window
from batchpilot.evaluation.report import _fmt, mean_ci

#: Live path -> the simulator's controller (``conf/policy/<name>.yaml``; vllm_tuned: the live
#: run's chosen flags as one grid point, ``tuned_point``).
TWIN_POLICY = {"vllm_direct": "vllm_default", "vllm_tuned": "vllm_tuned", "static": "static", "pid": "pid",
               "ppo": "ppo"}
#: The live path of vLLM with its own flags (run straight at vLLM, as vllm_direct).
TUNED_PATH = "vllm_tuned"
#: The paths whose order the twin must reproduce (issue 53: vllm_tuned, static, PID, PPO; and
#: vLLM as shipped), where the run has them.
RANKED_PATHS: tuple[str, ...] = ("vllm_tuned", "vllm_direct", "static", "pid", "ppo")
#: The gains the report follows: (path, over).
GAINS: tuple[tuple[str, str], ...] = (("ppo", "vllm_direct"), ("ppo", "pid"))
#: A simulated gain below this share of the reference path's simulated goodput counts as none.
MIN_REL_GAIN = 0.02
#: ... and below this many req/s in any case.
MIN_ABS_GAIN = 1e-3
#: The issue's target: at least this share of the simulated gain survives live.
TARGET_SHARE = 0.70
TWIN_ROW_KEYS: tuple[str, ...] = (
    "scenario", "path", "controller", "requests", "completed", "rejected", "accounted", "request_goodput",
    "request_goodput_run", "slo_attainment", "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "preemptions", "peak_kv_usage",
    "shield_interventions", "duration_s", "mean_batch_cap", "engine_iterations", "mean_iteration_tokens",
    "mean_admission_wait_ms", "mean_engine_ttft_ms", "error", "timeline",
)
SECTION = "## Simulated twin"
#: Row keys the twin and the live run both report on where the time went (key -> column title).
ENGINE_KEYS: dict[str, str] = {
    "mean_ttft_ms": "mean TTFT (ms)", "mean_admission_wait_ms": "admission wait (ms)",
    "mean_engine_ttft_ms": "engine TTFT (ms)", "engine_iterations": "iterations",
    "mean_iteration_tokens": "tokens an iteration",
}


# --- the workload -----------------------------------------------------------------------------
def stream_from_records(records: Sequence[Mapping[str, Any]], chunk_tokens: int, *, priority: int = 1,
                        duration_s: float | None = None) -> RequestStream:
    """The timed_trace records (what the client sends) as the simulator's request stream:
    arrival = ``timestamp``, lengths as written, prefix blocks = ``hash_ids`` of
    ``chunk_tokens`` tokens, every request at ``priority``. ``max_tokens`` = the output length,
    as vLLM's benchmark client sends it (``"max_tokens": output_len``), so the twin's admission
    charges what the live gateway's does."""
    if not records:
        raise ValueError("no records to replay")
    t = np.array([float(r["timestamp"]) for r in records])
    p = np.array([int(r["input_length"]) for r in records])
    o = np.array([int(r["output_length"]) for r in records])
    dur = float(t[-1]) if duration_s is None else max(float(duration_s), float(t[-1]))
    return RequestStream(t, p, o, duration_s=dur, priority=np.full(t.size, int(priority)),
                         prefix_hashes=[tuple(int(h) for h in r["hash_ids"]) for r in records],
                         prefix_block_tokens=int(chunk_tokens), info={"kind": "timed_trace"}, max_tokens=o)


def header_priority(headers: Sequence[str] | None, default: int) -> int:
    """The ``x-priority`` the live client sent (``client.headers``), else the gateway's default."""
    for h in headers or []:
        k, _, v = str(h).partition("=")
        if k.strip().lower() == "x-priority":
            return int(v.strip())
    return int(default)


def _vllm_arg(args: Sequence[Any], name: str) -> int | None:
    a = [str(x) for x in args]
    for i, x in enumerate(a):
        if x == name and i + 1 < len(a):
            return int(a[i + 1])
        if x.startswith(name + "="):
            return int(x.split("=", 1)[1])
    return None


#: The twin's profile: the in-process calibration plus the served path's measured extra.
TWIN_HARDWARE = "cpu_tiny_served"


def _serve_defaults() -> dict[str, Any]:
    serve = OmegaConf.load(REPO_ROOT / "conf" / "serve" / "default.yaml")
    app = OmegaConf.load(REPO_ROOT / "conf" / "serve_app.yaml")
    return {"default_priority": int(serve.get("default_priority", 1)),
            "breaker_shrink": float(app.shield.breaker_shrink)}


def twin_overrides(scenario: Mapping[str, Any], slo: Mapping[str, Any], vllm_args: Sequence[Any] = (),
                   extra: Sequence[str] = (), ingress_latency_s: float = 0.0, hardware: str = TWIN_HARDWARE) -> list[str]:
    """Hydra overrides (``conf/evaluate.yaml``) of the twin's simulator: the calibrated tiny
    model, the live engine's scheduler, KV budget and round trip, the gateway's control
    settings, the SLO. The control loop's interval, window, start knobs and scales are the
    ``control`` group's, which the evaluation composes as the gateway does."""
    sd = _serve_defaults()
    bs = _vllm_arg(vllm_args, "--block-size") or 32
    out = [
        "engine=sim", "model=tiny_llama", f"hardware={hardware}", f"engine.block_size={bs}",
        f"engine.max_num_batched_tokens={_vllm_arg(vllm_args, '--max-num-batched-tokens') or 2048}",
        f"engine.max_num_seqs={_vllm_arg(vllm_args, '--max-num-seqs') or 256}",
        f"engine.ingress_latency_s={float(ingress_latency_s)}",
        "workload=trace", f"workload.path={scenario['trace']}", f"workload.format={scenario['format']}",
        f"workload.start_s={float(scenario.get('start_s') or 0.0)}",
        f"workload.time_scale={float(scenario.get('time_scale') or 1.0)}",
        f"workload.duration_s={'null' if scenario.get('duration_s') is None else float(scenario['duration_s'])}",
        f"slo.ttft_ms={slo.get('ttft_ms')}", f"slo.tpot_ms={slo.get('tpot_ms')}",
        f"shield.breaker_shrink={sd['breaker_shrink']}", "logger=none",
        "env.drain_controlled=true",  # the gateway's loop runs on until the client's last answer
    ]
    blocks = _vllm_arg(vllm_args, "--num-gpu-blocks-override")
    if blocks is not None:
        out.append(f"engine.num_gpu_blocks_override={blocks}")
    return _merge_overrides(out, extra)


#: The gateway's overrides (``scripts/serve.py`` keys) the twin mirrors, as its own keys: the
#: shield and the control loop's timing and start knobs are one config group in both; the
#: gateway's admission is the env's.
GATEWAY_TO_TWIN: tuple[tuple[str, str], ...] = (("shield.", "shield."), ("control.", "control."),
                                                ("serve.admission.", "env.admission."))


def twin_gateway_overrides(gateway_overrides: Sequence[str]) -> list[str]:
    """The gateway overrides that change its shield, control loop timing or admission, as the
    twin's overrides, so a live run with e.g. ``shield.late_queue_overload=true`` or
    ``control.interval_s=0.5`` is predicted under the same ones; the others (ports, logging,
    ``serve.control.*``) have no twin key."""
    out = []
    for o in map(str, gateway_overrides):
        body = o.lstrip("+~")  # Hydra's add / delete prefixes stay as they were
        for src, dst in GATEWAY_TO_TWIN:
            if body.startswith(src):
                out.append(o[: len(o) - len(body)] + dst + body[len(src):])
    return out


def _merge_overrides(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` then ``extra``; an ``extra`` key=value replaces ``base``'s of the same key
    (Hydra refuses the same key twice)."""
    from batchpilot.evaluation.plan import override_key

    keys = {override_key(e) for e in extra}
    return [*(b for b in base if override_key(b) not in keys), *extra]


# --- running it -------------------------------------------------------------------------------
def _replay_env(cfg: DictConfig, records: Sequence[Mapping[str, Any]], chunk_tokens: int, priority: int,
                duration_s: float, engine: Mapping[str, Any] | None = None):
    """A ``ServingEnv`` whose every episode replays exactly ``records`` (a fresh stream per
    reset), instead of the stream its ``workload`` config would build. ``engine``: a server's own
    flags (vllm_tuned), run as ``VllmServerEnv`` runs them."""
    from batchpilot.envs.server_env import VllmServerEnv
    from batchpilot.envs.serving_env import ServingEnv, _shift_stream

    base: type[ServingEnv] = VllmServerEnv if engine is not None else ServingEnv

    class ReplayEnv(base):  # type: ignore[valid-type,misc]
        def reset(self, *, seed: int | None = None, options: dict | None = None):
            out = super().reset(seed=seed, options=options)
            stream = stream_from_records(records, chunk_tokens, priority=priority, duration_s=duration_s)
            self.stream = _shift_stream(stream, self._episode_start) if self._episode_start > 0 else stream
            return out

    return ReplayEnv(cfg, engine=engine) if engine is not None else ReplayEnv(cfg=cfg)


def tuned_point(flags: Mapping[str, Any], vllm_args: Sequence[Any] = ()) -> dict[str, Any]:
    """The matrix's policy for one ``vllm serve`` setting (a static cap, run as shipped, with the
    server's flags as ``engine``) from the live run's chosen vllm_tuned flags; a flag it did not
    set is the live engine's own (``vllm_args``, else vLLM's defaults the twin models)."""
    from batchpilot.evaluation.vllm_tuned import EngineGridPoint

    def flag(name: str, default: int | None) -> int | None:
        v = flags.get(name)
        return default if v is None else int(v)

    seqs = flag("max_num_seqs", _vllm_arg(vllm_args, "--max-num-seqs") or 256)
    tokens = flag("max_num_batched_tokens", _vllm_arg(vllm_args, "--max-num-batched-tokens") or 2048)
    assert seqs is not None and tokens is not None
    point = EngineGridPoint(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                            max_num_queued_tokens=flag("max_num_queued_tokens", None),
                            max_num_queued_reqs=flag("max_num_queued_reqs", None),
                            max_num_active_seqs=flag("max_num_active_seqs", None))
    return point.policy(TUNED_PATH)


def run_twin(tf: TimedTraceFile, scenario: Mapping[str, Any], slo: Mapping[str, Any], *,
             paths: Sequence[str] = tuple(TWIN_POLICY), vllm_args: Sequence[Any] = (), priority: int | None = None,
             seed: int = 0, extra_overrides: Sequence[str] = (), policy_overrides: Mapping[str, Any] | None = None,
             policy_dirs: Mapping[str, str] | None = None, slowdown: float = 1.0,
             ingress_latency_s: float = 0.0, hardware: str = TWIN_HARDWARE, tuned_flags: Mapping[str, Any] | None = None,
             log: Any = print) -> list[dict[str, Any]]:
    """One simulated episode per live path on the records of ``tf``; one row per path.
    ``policy_dirs``: more paths, each an exported policy folder run as the ``ppo`` controller
    (the live evaluation's ``policies``, e.g. a fine-tuned policy beside the shipped one).
    ``slowdown``: every simulated iteration takes this many times the profile's time
    (``HardwareSpec.slowdown``; ``match_slowdown`` fits it to the live reference path).
    ``ingress_latency_s``: the served round trip (``engine.ingress_latency_s``); ``hardware``: the
    profile (``conf/hardware``) of the served path on the live run's machine."""
    run = _twin_runner(tf, scenario, slo, paths=paths, vllm_args=vllm_args, priority=priority, seed=seed,
                       extra_overrides=extra_overrides, policy_overrides=policy_overrides, policy_dirs=policy_dirs,
                       ingress_latency_s=ingress_latency_s, hardware=hardware, tuned_flags=tuned_flags)
    return [run(path, slowdown, log) for path in paths]


def _twin_runner(tf: TimedTraceFile, scenario: Mapping[str, Any], slo: Mapping[str, Any], *, paths: Sequence[str],
                 vllm_args: Sequence[Any], priority: int | None, seed: int, extra_overrides: Sequence[str] = (),
                 policy_overrides: Mapping[str, Any] | None = None, policy_dirs: Mapping[str, str] | None = None,
                 ingress_latency_s: float = 0.0, hardware: str = TWIN_HARDWARE,
                 tuned_flags: Mapping[str, Any] | None = None) -> Callable[[str, float, Any], dict[str, Any]]:
    """Compose the twin's config once (Hydra's compose is most of a short twin's time); the
    returned ``run(path, slowdown, log)`` plays one path's episode and gives its row.
    ``tuned_flags``: the live run's vllm_tuned flags (needed for that path)."""
    from batchpilot.evaluation.matrix import (
        AS_SHIPPED_KEY,
        episode_config,
        make_controller,
        policy_config,
        run_episode,
        start_knobs,
    )
    from batchpilot.evaluation.plan import EvalConfig, compose_eval, engine_capabilities, plan_from_caps

    extra = dict(policy_dirs or {})
    bad = [p for p in paths if p not in TWIN_POLICY and p not in extra]
    if bad:
        raise ValueError(f"paths must be among {(*TWIN_POLICY, *extra)}, got {list(paths)}")
    if TUNED_PATH in paths and not tuned_flags:
        raise ValueError(f"path {TUNED_PATH}: the twin runs the live run's chosen flags, and none were given")
    sd = _serve_defaults()
    prio = sd["default_priority"] if priority is None else int(priority)
    names = {p: TWIN_POLICY.get(p, "ppo") for p in paths}
    composed = [n for p, n in names.items() if p != TUNED_PATH] or ["static"]  # vllm_tuned: built below
    overrides = [*twin_overrides(scenario, slo, vllm_args, extra_overrides, ingress_latency_s, hardware),
                 f"policies=[{','.join(dict.fromkeys(composed))}]",
                 f"seeds=[{int(seed)}]"]
    cfg, _ = compose_eval(overrides)
    ecfg = EvalConfig.from_cfg(cfg)
    duration = max(float(tf.duration_s), float(tf.records[-1]["timestamp"]))
    plan = plan_from_caps(str(scenario.get("name", "scenario")), cfg, engine_capabilities(cfg),
                          duration_s=duration, num_requests=len(tf))

    def run(path: str, slowdown: float, log: Any) -> dict[str, Any]:
        name = names[path]
        pol = tuned_point(tuned_flags or {}, vllm_args) if path == TUNED_PATH else policy_config(name, ecfg, plan)
        if name == "pid":  # the gateway's PID starts from its start-up cap, not pid.yaml's
            pol["initial_batch_cap"] = int(cfg.control.initial_batch_cap)
        pol.update((policy_overrides or {}).get(path, {}))
        if path in extra:
            pol["path"] = str(extra[path])
        # No controller given: a policy starts at control.initial_batch_cap, the gateway's start-up cap.
        knobs = start_knobs(pol, plan)
        as_shipped = bool(pol.get(AS_SHIPPED_KEY, False))
        ep_cfg = episode_config(plan, knobs, as_shipped)
        ep_cfg.hardware.slowdown = float(slowdown)
        env = _replay_env(ep_cfg, tf.records, tf.chunk_tokens, prio, duration, engine=pol.get("engine"))
        try:
            ep = run_episode(env, make_controller(pol, plan, name), int(seed), shielded=not as_shipped, record=True)
        finally:
            env.close()
        m = ep.metrics
        tl = ep.timeline
        assert tl is not None  # recorded
        completed, rejected = int(m["completed"]), int(m["rejected"])
        row = {"scenario": plan.name, "path": path, "controller": name + (" (as shipped)" if as_shipped else ""),
               "requests": len(tf), "completed": completed, "rejected": rejected,
               "accounted": completed + rejected == len(tf), "error": ep.error,
               "mean_batch_cap": float(np.mean(tl.batch_cap)) if tl.batch_cap else math.nan,
               # The knobs and queue per interval, beside the live run's decisions (cap_timeline.png).
               "timeline": {"time": tl.time, "batch_cap": tl.batch_cap, "queue_depth": tl.queue_depth},
               **{k: float(m.get(k, math.nan)) for k in TWIN_ROW_KEYS
                  if k in m and k not in ("completed", "rejected")}}
        log(f"sim twin: {path} ({row['controller']}): goodput {row['request_goodput']:.3f} req/s, "
            f"{completed}/{len(tf)} completed, {rejected} rejected, preemptions {row.get('preemptions', 0):.0f}, "
            f"{ep.wall_s:.1f} s")
        return {k: row.get(k, math.nan) for k in TWIN_ROW_KEYS}

    return run


#: The live path the twin's speed is matched to (vLLM as shipped: no controller, so how fast it
#: runs is the engine's and the machine's alone) and the client metric matched.
MATCH_PATH, MATCH_KEY = "vllm_direct", "mean_tpot_ms"
#: ... unless the run has vllm_tuned (also vLLM straight, no controller of ours), whose
#: concurrency (its --max-num-seqs, tens) is where the gateway paths run: one factor fitted at
#: vllm_direct's ~256 sequences ran the twin's 16-64-sequence paths at 1.5-1.7x their live TPOT
#: (2026-12-06: three runs, the twin's order of vllm_tuned against the gateway paths wrong on two).
TUNED_MATCH_PATH = "vllm_tuned"
#: The gateway path the gateway paths' extra factor is matched to: fixed knobs, no feedback, so
#: its speed is the engine's behind the gateway (the gateway shares the cores and proxies every
#: token), and the controlled paths' results stay predictions.
GATEWAY_MATCH_PATH = "static"
#: The slowdowns ``match_slowdown`` searches (a wider gap means a profile from another machine).
SLOWDOWN_RANGE = (0.25, 64.0)
#: The gateway factors searched (on top of the slowdown).
GATEWAY_FACTOR_RANGE = (0.25, 8.0)


def _live_target(live_rows: Sequence[Mapping[str, Any]], path: str) -> tuple[list[float], float | None]:
    live = [float(r[MATCH_KEY]) for r in live_rows
            if r.get("path") == path and r.get(MATCH_KEY) is not None and math.isfinite(float(r[MATCH_KEY]))]
    return live, (float(np.median(live)) if live else None)


def _bisect(sim: Callable[[float], float], target: float, bounds: tuple[float, float], rel_tol: float,
            max_iter: int) -> dict[str, Any]:
    """The factor in ``bounds`` at which the increasing ``sim`` hits ``target`` (log-space
    bisection); held at a bound when the target is outside what ``sim`` gives there."""
    f_lo, f_hi = sim(bounds[0]), sim(bounds[1])
    if not f_lo < target < f_hi:
        k, got = (bounds[0], f_lo) if target <= f_lo else (bounds[1], f_hi)
        return {"factor": k, "sim_ms": got, "matched": False,
                "reason": f"the live {MATCH_KEY} {target:.3g} ms is outside what the twin gives over "
                          f"{bounds} ({f_lo:.3g}–{f_hi:.3g} ms): held at {k}"}
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    for _ in range(max(1, max_iter)):
        mid = 0.5 * (lo + hi)
        k, got = math.exp(mid), sim(math.exp(mid))
        if abs(got - target) <= rel_tol * target:
            break
        lo, hi = (mid, hi) if got < target else (lo, mid)
    out = {"factor": k, "sim_ms": got, "matched": abs(got - target) <= rel_tol * target}
    if not out["matched"]:
        out["reason"] = f"closest: {got:.3g} ms at {k:.3g} (the twin's {MATCH_KEY} jumps near it)"
    return out


def match_slowdown(tf: TimedTraceFile, scenario: Mapping[str, Any], slo: Mapping[str, Any],
                   live_rows: Sequence[Mapping[str, Any]], *, vllm_args: Sequence[Any] = (), seed: int = 0,
                   rel_tol: float = 0.02, max_iter: int = 24, run: Any = None, gateway: bool = False,
                   path: str = MATCH_PATH, log: Any = print) -> dict[str, Any]:
    """The one factor by which the live engine ran slower (or faster) than the profile during
    this evaluation: the ``slowdown`` at which the twin's ``path`` (``vllm_direct``, or
    ``vllm_tuned``: ``TUNED_MATCH_PATH``) has that path's live runs' median mean TPOT (bisection
    in log space). Only that path's live rows are read, so the controlled paths' twin results
    stay predictions. Why: the profile is fitted
    on a quiet engine; during a live evaluation the client, the gateway and other jobs share the
    cores, and under overload the gap compounds (slower steps, more running, slower steps).

    ``gateway``: then also ``gateway_factor``, by which the paths through the gateway run
    slower still: matched on the ``static`` path's live runs (fixed knobs, no feedback) at
    ``slowdown * gateway_factor``; 1 without static runs. Measured on a 2-core machine, static's
    TPOT was 1.7x the vllm_direct-matched twin's, and a twin that fast let PID grow its cap
    twice as fast as it did live (cap_timeline.png).
    ``run``: a ``_twin_runner`` of the same twin, to skip composing its config again."""
    live, target = _live_target(live_rows, path)
    out: dict[str, Any] = {"path": path, "key": MATCH_KEY, "live_runs": len(live), "slowdown": 1.0,
                           "matched": False, "gateway_factor": 1.0}
    if target is None:
        out["reason"] = f"no live {path} run with {MATCH_KEY}: the profile's speed is used"
        return out
    if run is None:
        paths = [path, GATEWAY_MATCH_PATH] if gateway else [path]
        run = _twin_runner(tf, scenario, slo, paths=paths, vllm_args=vllm_args, priority=None, seed=seed)

    def sim(path: str, k: float) -> float:
        return float(run(path, k, lambda *_: None)[MATCH_KEY])

    out.update(target_ms=target, profile_ms=sim(path, 1.0))
    m = _bisect(lambda k: sim(path, k), target, SLOWDOWN_RANGE, rel_tol, max_iter)
    k = m.pop("factor")
    out.update(slowdown=k, **m)
    log(f"sim twin: slowdown {k:.3g} ({path} {MATCH_KEY}: live median {target:.3g} ms, twin {m['sim_ms']:.3g} ms, "
        f"profile alone {out['profile_ms']:.3g} ms)")
    if gateway:
        g_live, g_target = _live_target(live_rows, GATEWAY_MATCH_PATH)
        gw: dict[str, Any] = {"path": GATEWAY_MATCH_PATH, "live_runs": len(g_live), "factor": 1.0, "matched": False}
        if g_target is None:
            gw["reason"] = f"no live {GATEWAY_MATCH_PATH} run: the gateway paths run at the slowdown alone"
        else:
            gw.update(target_ms=g_target, at_slowdown_ms=sim(GATEWAY_MATCH_PATH, k))
            gw.update(_bisect(lambda g: sim(GATEWAY_MATCH_PATH, k * g), g_target, GATEWAY_FACTOR_RANGE, rel_tol,
                              max_iter))
            log(f"sim twin: gateway factor {gw['factor']:.3g} ({GATEWAY_MATCH_PATH} {MATCH_KEY}: live median "
                f"{g_target:.3g} ms, twin {gw['sim_ms']:.3g} ms, {gw['at_slowdown_ms']:.3g} ms at the slowdown alone)")
        out["gateway"] = gw
        out["gateway_factor"] = float(gw["factor"])
    return out


def twin_of_rows(tf: TimedTraceFile, scenario: Mapping[str, Any], slo: Mapping[str, Any],
                 live_rows: Sequence[Mapping[str, Any]], *, paths: Sequence[str], match: bool = True,
                 match_gateway: bool = True, vllm_args: Sequence[Any] = (), priority: int | None = None,
                 seed: int = 0, policy_dirs: Mapping[str, str] | None = None,
                 gateway_overrides: Sequence[str] = (), speed: Mapping[str, Any] | None = None,
                 ingress_latency_s: float = 0.0, hardware: str = TWIN_HARDWARE,
                 tuned_flags: Mapping[str, Any] | None = None,
                 log: Any = print) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The twin of a live evaluation's rows: with ``match``, its speed first matched to the live
    reference path(s) (``match_slowdown``; ``match_gateway``: the gateway paths' factor too), or
    ``speed`` given (another run's match, ``speed_of``); then one episode per path, under the
    gateway's shield and admission overrides, with the served round trip ``ingress_latency_s``.
    Returns rows and the match."""
    match = match and speed is None  # a given speed is not matched again
    ref = TUNED_MATCH_PATH if tuned_flags and any(r["path"] == TUNED_MATCH_PATH for r in live_rows) else MATCH_PATH
    refs = [ref, GATEWAY_MATCH_PATH] if match and match_gateway else [ref]
    run = _twin_runner(tf, scenario, slo, paths=[*dict.fromkeys([*paths, *refs])],
                       vllm_args=vllm_args, priority=priority, seed=seed, policy_dirs=policy_dirs,
                       extra_overrides=twin_gateway_overrides(gateway_overrides), ingress_latency_s=ingress_latency_s,
                       hardware=hardware, tuned_flags=tuned_flags)
    if match:
        m: dict[str, Any] | None = match_slowdown(tf, scenario, slo, live_rows, seed=seed, run=run,
                                                  gateway=match_gateway, path=ref, log=log)
    else:
        m = dict(speed) if speed is not None else None
    k = float(m["slowdown"]) if m else 1.0
    g = float(m.get("gateway_factor", 1.0)) if m else 1.0
    # vLLM straight (as shipped, or with its own flags) at the engine's speed; through the gateway x g.
    return [run(path, k if path in (MATCH_PATH, TUNED_PATH) else k * g, log) for path in paths], m


# --- the share that survives ------------------------------------------------------------------
def survival(sim_gain: float, sim_ref: float, live_gain: float, live_ci: float, *,
             min_rel: float = MIN_REL_GAIN, min_abs: float = MIN_ABS_GAIN,
             target: float = TARGET_SHARE) -> dict[str, Any]:
    """The share of a simulated gain that survives live: ``live_gain / sim_gain`` with the live
    paired CI carried through (``(live_gain ± live_ci) / sim_gain``). A simulated gain within
    ``max(min_abs, min_rel * sim_ref)`` of 0 (``sim_ref``: the reference path's simulated
    goodput), or a simulated loss, has nothing to survive: share None and a verdict saying so."""
    tol = max(min_abs, min_rel * abs(sim_ref)) if math.isfinite(sim_ref) else min_abs
    out: dict[str, Any] = {"sim_gain": sim_gain, "live_gain": live_gain, "live_ci": live_ci, "tolerance": tol,
                           "share": None, "share_lo": None, "share_hi": None, "target_met": None}
    if not math.isfinite(sim_gain):
        out["verdict"] = "no simulated result"
        return out
    if abs(sim_gain) <= tol:
        out["verdict"] = f"no simulated gain to survive (simulated gain {sim_gain:+.3g} req/s, within ±{tol:.2g})"
        return out
    if sim_gain < 0:
        out["verdict"] = f"the simulator predicts a loss ({sim_gain:+.3g} req/s): no simulated gain to survive"
        return out
    if not math.isfinite(live_gain):
        out["verdict"] = "no live result"
        return out
    share = live_gain / sim_gain
    out["share"] = share
    if math.isfinite(live_ci):
        out["share_lo"], out["share_hi"] = (live_gain - live_ci) / sim_gain, (live_gain + live_ci) / sim_gain
    out["target_met"] = bool(share >= target)
    ci = f" (live CI → {out['share_lo']:.0%} … {out['share_hi']:.0%})" if out["share_lo"] is not None else ""
    out["verdict"] = (f"{share:.0%} survives{ci}; target ≥ {target:.0%} "
                      f"{'met' if share >= target else 'not met'}"
                      + ("" if out["share_lo"] is None or out["share_lo"] > 0 else
                         ", and the live interval includes 0"))
    return out


def _live_means(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float, int]]:
    paths = dict.fromkeys(r["path"] for r in rows)
    return {p: mean_ci([_num(r.get("request_goodput")) for r in rows if r["path"] == p]) for p in paths}


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def live_paired(rows: Sequence[Mapping[str, Any]], path: str, over: str,
                key: str = "request_goodput") -> tuple[float, float, int]:
    """Mean and 95 % CI half-width of ``path - over`` paired by round (live rows)."""
    base = {r["round"]: _num(r.get(key)) for r in rows if r["path"] == over}
    diffs = [_num(r.get(key)) - base[r["round"]] for r in rows if r["path"] == path and r["round"] in base]
    return mean_ci(diffs)


def twin_summary(sim_rows: Sequence[Mapping[str, Any]], live_rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per path the simulated and live goodput; per gain (``GAINS``) simulated vs live and the
    share that survives."""
    # vLLM's benchmark client divides by the whole run, drain included: the twin's figure
    # measured the same way is request_goodput_run (request_goodput is over the arrival window).
    sim = {r["path"]: _num(r.get("request_goodput_run", r.get("request_goodput"))) for r in sim_rows}
    live = _live_means(live_rows)
    gains = []
    for path, over in GAINS:
        if path not in sim or over not in sim:
            continue
        sg = sim[path] - sim[over]
        lg, lci, n = live_paired(live_rows, path, over) if path in live and over in live else (math.nan, math.nan, 0)
        s = survival(sg, sim[over], lg, lci)
        gains.append({"path": path, "over": over, "live_rounds": n, **s})
    def live_mean(key: str, p: str) -> float:
        return mean_ci([_num(r.get(key)) for r in live_rows if r["path"] == p])[0]

    return {"ranking": ranking(sim_rows, live_rows),
            "paths": {p: {"sim": sim[p], "live_mean": live.get(p, (math.nan,))[0],
                          "live_ci": live.get(p, (math.nan, math.nan))[1],
                          "live_mean_tpot_ms": live_mean("mean_tpot_ms", p),
                          "live_mean_batch_cap": live_mean("mean_batch_cap", p),
                          **{f"live_{k}": live_mean(k, p) for k in ENGINE_KEYS}}
                      for p in sim},
            "gains": gains}


def ranking(sim_rows: Sequence[Mapping[str, Any]], live_rows: Sequence[Mapping[str, Any]],
            paths: Sequence[str] = RANKED_PATHS) -> dict[str, Any]:
    """The order of ``paths`` (those the run has) by goodput in the twin (over the run, as the
    client measures) and live (the mean over rounds), and every pair whose order flips, with the
    live paired difference: a flip whose live interval includes 0 is within the noise."""
    sim = {r["path"]: _num(r.get("request_goodput_run", r.get("request_goodput"))) for r in sim_rows}
    live = _live_means(live_rows)
    common = [p for p in paths if p in sim and p in live]
    by_sim = sorted(common, key=lambda p: -sim[p])
    by_live = sorted(common, key=lambda p: -live[p][0])
    flips = []
    for i, a in enumerate(by_sim):
        for b in by_sim[i + 1:]:
            if live[a][0] < live[b][0]:  # the twin puts a ahead, live puts b ahead
                d, ci, n = live_paired(live_rows, b, a)
                flips.append({"ahead_in_sim": a, "ahead_live": b, "sim_diff": sim[a] - sim[b], "live_diff": d,
                              "live_ci": ci, "live_rounds": n,
                              "clear": bool(math.isfinite(d) and math.isfinite(ci) and d - ci > 0)})
    return {"sim": by_sim, "live": by_live, "same": by_sim == by_live, "flips": flips}


def ranking_markdown(rank: Mapping[str, Any]) -> str:
    """One paragraph: both orders, and each flip with its live paired difference."""
    if len(rank.get("sim", [])) < 2:
        return "Ranking: fewer than two of " + ", ".join(RANKED_PATHS) + " ran, nothing to order."
    text = (f"Ranking by goodput: twin {' > '.join(rank['sim'])}; live {' > '.join(rank['live'])}"
            f" — {'the same order' if rank['same'] else 'not the same order'}.")
    for f in rank["flips"]:
        ci = _num(f["live_ci"])
        live = f"{_num(f['live_diff']):+.3f}" + (f" ± {ci:.3f}" if math.isfinite(ci) else "")
        text += (f" {f['ahead_live']} − {f['ahead_in_sim']}: twin {-_num(f['sim_diff']):+.3f} req/s, live {live} "
                 f"({'clear of the noise' if f['clear'] else 'within the noise'}).")
    return text


def speed_of(run_dir: str | Path) -> dict[str, Any]:
    """Another live run's twin speed (its twin.json ``match``), for a twin that cannot match its
    own (no vllm_direct runs), marked with the run it was matched on (a run that took its speed
    from a third passes that one on)."""
    path = Path(run_dir) / "twin.json"
    try:
        match = json.loads(path.read_text()).get("match")
    except (OSError, ValueError) as exc:
        raise ValueError(f"twin_speed_of: cannot read {path}: {exc}") from None
    if not isinstance(match, dict) or not match.get("matched") or "slowdown" not in match:
        raise ValueError(f"twin_speed_of: {path} has no matched speed (its twin ran at the profile's speed)")
    return {**match, "given_from": match.get("given_from") or str(run_dir)}


def match_markdown(match: Mapping[str, Any] | None) -> str:
    """One paragraph on the twin's speed: the profile's, or matched to the live reference path
    (of this run, or of the run it was given from)."""
    if not match:
        return "Speed: the profile's (`hardware.slowdown` 1, not matched to the live runs)."
    if match.get("given_from"):
        return (f"Speed given from another run (`twin_speed_of`: {match['given_from']}, matched there on its "
                f"{match.get('path', 'vllm_direct')} and {match.get('gateway', {}).get('path', 'static')} runs): "
                f"**slowdown {float(match['slowdown']):.2f}**, the gateway paths at "
                f"**{float(match.get('gateway_factor', 1.0)):.2f}×** that. Every path's twin result here is a "
                "prediction.")
    if "target_ms" not in match:
        return f"Speed: the profile's — {match.get('reason', 'not matched')}."
    text = (f"Speed matched to the live reference: **slowdown {match['slowdown']:.2f}** (every simulated iteration "
            f"takes {match['slowdown']:.2f}× the profile's time), at which the twin's {match['path']} "
            f"{match['key']} is {match['sim_ms']:.3g} ms against the live median {match['target_ms']:.3g} ms "
            f"over {match['live_runs']} runs (the profile alone: {match['profile_ms']:.3g} ms). Only "
            f"{match['path']}'s live {match['key']} is used; the other paths' twin results are predictions.")
    text += f" Not matched within 2 %: {match['reason']}." if match.get("reason") else ""
    gw = match.get("gateway")
    if gw and "target_ms" in gw:
        text += (f" The paths through the gateway run at **{gw['factor']:.2f}×** that (the gateway shares the "
                 f"cores and proxies every token), at which the twin's {gw['path']} {match['key']} is "
                 f"{gw['sim_ms']:.3g} ms against the live median {gw['target_ms']:.3g} ms over {gw['live_runs']} "
                 f"runs ({gw['at_slowdown_ms']:.3g} ms at the slowdown alone); {gw['path']} has fixed knobs, so the "
                 f"controlled paths stay predictions.")
        text += f" Not matched within 2 %: {gw['reason']}." if gw.get("reason") else ""
    elif gw:
        text += f" Gateway paths: {gw.get('reason', 'not matched')}."
    return text


def twin_markdown(sim_rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], note: str = "",
                  match: Mapping[str, Any] | None = None, hardware: str = TWIN_HARDWARE) -> str:
    lines = [SECTION, ""]
    if note:
        lines += [note, ""]
    lines += ["The same converted requests on the calibrated simulator (`engine=sim model=tiny_llama "
              f"hardware={hardware}`, one deterministic episode per path; vllm_direct ≙ `vllm_default` as shipped).",
              "", match_markdown(match),
              "", "| path | controller (sim) | sim goodput, run (req/s) | live goodput (mean ± 95 % CI) | sim SLO attainment "
              "| sim completed / rejected | sim preemptions | sim peak KV | mean TPOT sim / live (ms) "
              "| mean batch cap sim / live |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sim_rows:
        lv = summary["paths"].get(r["path"], {})
        lm, lc = _num(lv.get("live_mean")), _num(lv.get("live_ci"))
        live = "–" if not math.isfinite(lm) else (_fmt(lm) if not math.isfinite(lc) else f"{_fmt(lm)} ± {_fmt(lc)}")
        lines.append(f"| {r['path']} | {r['controller']} | {_fmt(_num(r.get('request_goodput_run', r['request_goodput'])))} | {live} | "
                     f"{_fmt(_num(r['slo_attainment']))} | {r['completed']} / {r['rejected']} | "
                     f"{_fmt(_num(r['preemptions']))} | {_fmt(_num(r['peak_kv_usage']))} | "
                     f"{_fmt(_num(r['mean_tpot_ms']))} / {_fmt(_num(lv.get('live_mean_tpot_ms')))} | "
                     f"{_fmt(_num(r.get('mean_batch_cap')))} / {_fmt(_num(lv.get('live_mean_batch_cap')))} |")
    lines += ["", "Where the time goes, sim / live (live: the gateway's and vLLM's own metrics, means over the "
              "rounds; the engine's TTFT runs from admission, live from vLLM's API server, to the first token):", "",
              "| path | " + " | ".join(ENGINE_KEYS.values()) + " |", "|---|" + "---:|" * len(ENGINE_KEYS)]
    for r in sim_rows:
        lv = summary["paths"].get(r["path"], {})
        lines.append(f"| {r['path']} | " + " | ".join(
            f"{_fmt(_num(r.get(k)))} / {_fmt(_num(lv.get(f'live_{k}')))}" for k in ENGINE_KEYS) + " |")
    if summary.get("ranking"):
        lines += ["", ranking_markdown(summary["ranking"])]
    if not summary["gains"]:  # one line, not a table's header with no rows
        return "\n".join([*lines, "", no_gain_note([str(r["path"]) for r in sim_rows])]) + "\n"
    lines += ["", "| gain | simulated (req/s) | live, paired (req/s, 95 % CI) | share that survives live |",
              "|---|---:|---:|---|"]
    for g in summary["gains"]:
        lg, lci = _num(g["live_gain"]), _num(g["live_ci"])
        live = "–" if not math.isfinite(lg) else (f"{lg:+.3f}" if not math.isfinite(lci) else f"{lg:+.3f} ± {lci:.3f}")
        lines.append(f"| {g['path']} − {g['over']} | {_num(g['sim_gain']):+.3f} | {live} | {g['verdict']} |")
    return "\n".join(lines) + "\n"


def no_gain_note(paths: Sequence[str]) -> str:
    """Why the twin has no gain to follow: each of ``GAINS`` needs both of its paths."""
    gains = " and ".join(f"{p} − {o}" for p, o in GAINS)
    heads = list(dict.fromkeys(p for p, _ in GAINS))
    if not any(h in paths for h in heads):
        lack = "no " + " or ".join(heads)
    else:
        lack = "neither " + " nor ".join(dict.fromkeys(o for _, o in GAINS))
    return (f"No gain to compare with live: the twin follows {gains}, and this run's paths "
            f"({', '.join(paths) or 'none'}) have {lack}.")


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def write_twin(out_dir: Path, sim_rows: Sequence[Mapping[str, Any]], live_rows: Sequence[Mapping[str, Any]],
               note: str = "", match: Mapping[str, Any] | None = None, hardware: str = TWIN_HARDWARE) -> dict[str, Any]:
    """twin.json (sim rows, the speed match, summary) and the "Simulated twin" section of
    results.md (replaced when there is one already)."""
    summary = twin_summary(sim_rows, live_rows)
    body = {"rows": list(map(dict, sim_rows)), "match": dict(match) if match else None, "hardware": hardware,
            **summary}
    (out_dir / "twin.json").write_text(json.dumps(_clean(body),
                                                  indent=1, ensure_ascii=False) + "\n")
    md_path = out_dir / "results.md"
    md = md_path.read_text() if md_path.exists() else "# Live evaluation\n"
    md = re.split(r"\n" + re.escape(SECTION) + r"\n", md, maxsplit=1)[0].rstrip("\n") + "\n\n"
    md_path.write_text(md + twin_markdown(sim_rows, summary, note, match, hardware))
    plot_cap_timelines(out_dir, sim_rows)
    return summary


def plot_cap_timelines(out_dir: Path, sim_rows: Sequence[Mapping[str, Any]]) -> Path | None:
    """``cap_timeline.png``: per gateway path, the batch cap over a run's seconds, every live
    run (``runs/*_<path>.decisions.jsonl``) beside the twin's episode; None without live decisions.
    Where the twin's controller and the live one part ways shows here before it shows in goodput."""
    live: dict[str, list[tuple[list[float], list[float]]]] = {}
    for r in sim_rows:
        for f in sorted((out_dir / "runs").glob(f"r*_{r['path']}.decisions.jsonl")):
            recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            if recs:
                t0 = float(recs[0]["t"])
                live.setdefault(r["path"], []).append(([float(d["t"]) - t0 for d in recs],
                                                       [float(d["batch_cap"]) for d in recs]))
    if not live:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(live)
    fig, axes = plt.subplots(1, len(paths), figsize=(4.5 * len(paths), 3.2), squeeze=False, sharey=True)
    for ax, path in zip(axes[0], paths):
        for i, (t, cap) in enumerate(live[path]):
            ax.plot(t, cap, color="tab:blue", alpha=0.35, lw=1, label="live runs" if i == 0 else None)
        tl = next(r.get("timeline") for r in sim_rows if r["path"] == path)
        if isinstance(tl, Mapping) and tl.get("time"):
            t0 = float(tl["time"][0])
            ax.plot([float(x) - t0 for x in tl["time"]], tl["batch_cap"], color="black", lw=2, label="twin")
        ax.set_title(path)
        ax.set_xlabel("seconds into the run")
    axes[0][0].set_ylabel("batch cap")
    axes[0][0].legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = out_dir / "cap_timeline.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def twin_of(out_dir: str | Path, log: Any = print, speed_from: str | Path | None = None,
            ingress_latency_s: float = 0.0, hardware: str = TWIN_HARDWARE) -> dict[str, Any]:
    """The twin of a finished live run: its config (``.hydra/config.yaml``, else results.json's
    meta), its window re-converted the same way, its rows from results.json; its speed matched on
    its own runs, or ``speed_from`` another run's (``speed_of``); the served round trip given
    (the caller's ``twin_ingress_latency_s``, so an older run is re-twinned as a new one would be)."""
    d = Path(out_dir)
    res = json.loads((d / "results.json").read_text())
    hcfg = d / ".hydra" / "config.yaml"
    if hcfg.exists():
        cfg = OmegaConf.load(hcfg)
        scenario, slo = cfg.live_scenario, OmegaConf.to_container(cfg.slo, resolve=True)
        headers = list(cfg.get("client", {}).get("headers") or [])
        vargs = [*(cfg.get("gateway", {}).get("extra_vllm_args") or []), *scenario.vllm_args]
        seed = int(cfg.get("seed", 0))
        match = bool(cfg.get("twin_match", True))
        match_gateway = bool(cfg.get("twin_match_gateway", True))
        gw_over = [str(o) for o in (cfg.get("gateway", {}).get("overrides") or [])]
    else:
        scenario, slo, headers, seed = OmegaConf.create(res["meta"]["scenario"]), res["meta"]["slo"], [], 0
        vargs, match, match_gateway, gw_over = list(scenario.vllm_args), True, True, []
    tf = scenario_trace(scenario)
    sc = OmegaConf.to_container(scenario, resolve=True)
    load = res["meta"].get("load") or {}
    if load.get("load_multiple") is not None:  # sized to the machine: the window the runs replayed
        sc, tf = sized_window(scenario, tf, float(load["load_multiple"]) * float(load["capacity_req_s"]))
    # The file read: a relative trace found in the current folder (resolve_trace_path, as the live
    # run found it) is not looked for there by the simulator, which reads relative paths from the repo.
    sc = {**sc, "trace": tf.source}
    if len(tf) != int(res["meta"].get("requests_per_run", len(tf))):
        raise ValueError(f"{d}: the window converts to {len(tf)} requests, the live run sent "
                         f"{res['meta'].get('requests_per_run')}")
    assert isinstance(slo, dict)
    assert isinstance(sc, dict)
    tuned_flags = ((res["meta"].get("vllm_tuned") or {}).get("chosen") or {}).get("setting")
    rows, m = twin_of_rows(tf, sc, slo, res["rows"], match=match, match_gateway=match_gateway,
                           paths=[p for p in TWIN_POLICY if any(r["path"] == p for r in res["rows"])
                                  and (p != TUNED_PATH or tuned_flags)], tuned_flags=tuned_flags,
                           vllm_args=vargs, priority=header_priority(headers, _serve_defaults()["default_priority"]),
                           seed=seed, gateway_overrides=gw_over, log=log,
                           speed=speed_of(speed_from) if speed_from else None, ingress_latency_s=ingress_latency_s,
                           hardware=hardware)
    summary = write_twin(d, rows, res["rows"], match=m, hardware=hardware)
    return {"rows": rows, "match": m, **summary}


__all__ = [
    "GAINS", "RANKED_PATHS", "TARGET_SHARE", "TUNED_PATH", "TWIN_POLICY", "header_priority", "live_paired",
    "match_slowdown", "ranking", "ranking_markdown", "run_twin", "speed_of", "tuned_point",
    "stream_from_records", "survival", "twin_gateway_overrides", "twin_markdown", "twin_of", "twin_of_rows",
    "twin_overrides", "twin_summary", "write_twin",
]
