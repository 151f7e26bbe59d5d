"""Speed benchmarks. ``python scripts/bench.py target=sim`` prints a small table and, as the
last line, one JSON object with the figures (so scripts can parse it)."""

from __future__ import annotations

import json
import math
import resource
import time
from typing import Any, Callable

import hydra
import numpy as np
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

import batchpilot.schemas  # noqa: F401  (stores the config schemas before Hydra composes)
from batchpilot.core.engine import Request
from batchpilot.envs.sim_engine import SimEngine


def bench_sim(cfg: DictConfig) -> dict[str, Any]:
    """Drive SimEngine with a saturating Poisson load for ``cfg.sim.wall_seconds`` of wall time."""
    b = cfg.sim
    engine = SimEngine.from_cfg(cfg)
    rng = np.random.default_rng(cfg.seed)
    mml = engine.model.max_model_len
    chunk = 4096
    rate, max_waiting = float(b.arrival_rate_per_s), int(b.max_waiting)
    p_mu, o_mu, sigma = np.log(float(b.prompt_mean)), np.log(float(b.output_mean)), float(b.length_sigma)
    iters = finished = added = skipped = 0
    run_weighted = 0.0
    t = 0.0
    start = time.perf_counter()
    deadline = start + float(b.wall_seconds)
    while time.perf_counter() < deadline:
        gaps = rng.exponential(1.0 / rate, chunk).tolist()
        prompts = np.clip(rng.lognormal(p_mu, sigma, chunk), 1, mml // 2).astype(int).tolist()
        outputs = np.clip(rng.lognormal(o_mu, sigma, chunk), 1, mml // 2).astype(int).tolist()
        for i in range(chunk):
            t += gaps[i]
            r = engine.advance_until(t)
            iters += r.num_iterations
            finished += len(r.finished)
            run_weighted += r.num_iterations * engine.num_running
            if engine.num_waiting < max_waiting:
                engine.add_request(Request(f"b{added + skipped}", t, prompts[i], outputs[i]))
                added += 1
            else:
                skipped += 1
        if time.perf_counter() >= deadline:
            break
    wall = time.perf_counter() - start
    s = engine.stats()
    return {
        "target": "sim",
        "hardware": engine.hw.name,
        "model": engine.model.name,
        "wall_s": round(wall, 3),
        "iterations": iters,
        "iterations_per_s": round(iters / wall, 1),
        "sim_seconds": round(engine.now, 3),
        "sim_seconds_per_wall_s": round(engine.now / wall, 2),
        "requests_added": added,
        "requests_finished": finished,
        "mean_running_seqs": round(run_weighted / max(iters, 1), 1),
        "num_preemptions": s.num_preemptions,
        "kv_cache_usage": round(s.kv_cache_usage, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def bench_env(cfg: DictConfig) -> dict[str, Any]:
    """ServingEnv steps per wall second on the simulator, 1 s interval, moderate load."""
    from batchpilot.config import load_config
    from batchpilot.envs.serving_env import ServingEnv

    b = cfg.env_bench
    env_cfg = load_config(
        [f"hardware={cfg.hardware_name}", f"model={cfg.model_name}", "engine=sim",
         f"workload={b.workload}", f"workload.rate={b.rate}", f"control.interval_s={b.interval_s}",
         *b.overrides]
    )
    env = ServingEnv(cfg=env_cfg)
    env.reset(seed=int(cfg.seed))
    hold = np.array([2, 0, 0])  # keep the cap, FIFO, keep the dtype
    steps = episodes = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < float(b.wall_seconds):
        _, _, terminated, truncated, info = env.step(hold)
        steps += 1
        if terminated or truncated:
            episodes += 1
            env.reset()
    wall = time.perf_counter() - t0
    env.close()
    return {
        "env_steps_per_s": round(steps / wall, 1),
        "steps": steps,
        "episodes": episodes,
        "interval_s": float(b.interval_s),
        "arrival_rate": float(b.rate),
        "overrides": list(b.overrides),
        "last_kv_cache_usage": round(info["metrics"]["kv_cache_usage"], 3),
        "last_num_running": info["metrics"]["num_running"],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def bench_policy(cfg: DictConfig) -> dict[str, Any]:
    """Decision latency of the dependency-light runtime on the shipped (or given) policy."""
    from batchpilot.config import REPO_ROOT
    from batchpilot.policies.runtime import benchmark_runtime

    path = cfg.policy_bench.path or REPO_ROOT / "policies" / "pretrained"
    return benchmark_runtime(path, int(cfg.policy_bench.n_calls), with_mask=True)


def bench_gateway(cfg: DictConfig) -> dict[str, Any]:
    """Added latency of the gateway over calling a real `vllm serve` directly."""
    from batchpilot.serving.bench import bench_gateway as run

    return run(cfg)


def bench_served_decode(cfg: DictConfig) -> dict[str, Any]:
    """The served path against the calibrated simulator: ``n`` simultaneous requests through a
    real ``vllm serve`` (tiny model), wall ms per output token, beside the decode step the
    simulator predicts on the profile (``conf/hardware/cpu_tiny.yaml``, fitted on
    ``engine.step()`` in process), and the fit of the difference (docs/sim_to_real.md)."""
    from batchpilot.evaluation.calibration import fit_served_profile
    from batchpilot.serving.served_decode import measure_served_decode

    b = cfg.served_decode
    _, _, fit = fit_served_profile(str(b.profile), measure_served_decode(b), b)
    rows = [{"n": n, "served_ms_per_token": round(ms, 2), "sim_step_ms": round(pred, 2), "ratio": round(ms / pred, 2)}
            for n, ms, pred in fit.points]
    return {"target": "served_decode", "profile": str(b.profile), "rows": rows,
            "extra_ms_per_step": round(fit.per_step_s * 1e3, 3),
            "extra_ms_per_sequence": round(fit.per_sequence_s * 1e3, 4)}


def bench_served_round_trip(cfg: DictConfig) -> dict[str, Any]:
    """The served round trip against the simulator: one-token requests sent one at a time to an
    idle real ``vllm serve``, client wall ms, beside the one iteration the simulator charges
    (hardware=<profile>); the difference is what ``engine.ingress_latency_s`` stands for."""
    from batchpilot.evaluation.calibration import tiny_profile
    from batchpilot.serving.served_decode import measure_round_trip

    b = cfg.served_round_trip
    p = int(b.prompt_tokens)
    walls = np.array(measure_round_trip(p, int(b.requests), int(b.warmup))) * 1e3
    _, _, st = tiny_profile(str(b.profile))
    sim_ms = st.step_time(p, p * (p + 1) / 2.0, p, 0, 0, 1) * 1e3
    med = float(np.median(walls))
    return {"target": "served_round_trip", "profile": str(b.profile), "prompt_tokens": p, "requests": int(walls.size),
            "median_ms": round(med, 2), "p10_ms": round(float(np.percentile(walls, 10)), 2),
            "p90_ms": round(float(np.percentile(walls, 90)), 2), "sim_iteration_ms": round(sim_ms, 2),
            "round_trip_ms": round(med - sim_ms, 2)}


def bench_http_client(cfg: DictConfig) -> dict[str, Any]:
    """The gateway's hot-path HTTP client against aiohttp's, side by side."""
    from batchpilot.serving.client_bench import bench_http_client as run

    return run(cfg.get("client_bench"))


TARGETS: dict[str, Callable[[DictConfig], dict[str, Any]]] = {
    "sim": bench_sim,
    "env": bench_env,
    "policy": bench_policy,
    "gateway": bench_gateway,
    "http_client": bench_http_client,
    "served_decode": bench_served_decode,
    "served_round_trip": bench_served_round_trip,
}


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from batchpilot.schemas import check_app
    from batchpilot.schemas.bench import BenchApp

    check_app(BenchApp, cfg)  # a key added with +key=... (the rest was checked at compose)
    if cfg.target not in TARGETS:
        raise SystemExit(f"unknown bench target {cfg.target!r}; choose one of {sorted(TARGETS)}")
    for node, key in (("sim", "wall_seconds"), ("sim", "arrival_rate_per_s"), ("sim", "prompt_mean"),
                      ("sim", "output_mean"), ("env_bench", "wall_seconds"), ("env_bench", "rate"),
                      ("env_bench", "interval_s")):
        v = float(cfg[node][key])
        if not (math.isfinite(v) and v > 0):  # a rate of 0 divided by zero; a wall time of 0 measured nothing
            raise SystemExit(f"bench: error: {node}.{key} must be a finite number > 0, got {cfg[node][key]}")
    result = TARGETS[cfg.target](cfg)
    table = Table(title=f"bench {cfg.target}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, str(v))
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
