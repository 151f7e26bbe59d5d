"""The probes before the rounds, which decide what the rounds replay: the capacity probe that
sizes a scenario's load to this machine (``machine_load``), and vllm_tuned's flags (``tune_flags``:
given, or swept on the tuning window, after a prefill probe where a setting needs one)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from batchpilot.envs.timed_trace import TimedTraceFile
from batchpilot.evaluation.live_client import row_from_result
from batchpilot.evaluation.live_errors import LiveEvaluationError
from batchpilot.evaluation.live_results import BASELINE, finite_or_none
from batchpilot.evaluation.live_tuned import (
    TUNED,
    TunedConfigError,
    check_disjoint,
    choose,
    needs_prefill_probe,
    resolve_setting,
    setting_label,
    tuning_scenario,
)
from batchpilot.evaluation.live_window import scenario_label, scenario_trace, sized_window


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
