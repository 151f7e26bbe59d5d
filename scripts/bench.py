"""Speed benchmarks. ``python scripts/bench.py target=sim`` prints a small table and, as the
last line, one JSON object with the figures (so scripts can parse it)."""

from __future__ import annotations

import json
import resource
import time
from typing import Any, Callable

import hydra
import numpy as np
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from batchpilot.envs.engine import Request
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


TARGETS: dict[str, Callable[[DictConfig], dict[str, Any]]] = {"sim": bench_sim}


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.target not in TARGETS:
        raise SystemExit(f"unknown bench target {cfg.target!r}; choose one of {sorted(TARGETS)}")
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
