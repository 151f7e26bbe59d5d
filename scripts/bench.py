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
         f"workload={b.workload}", f"workload.rate={b.rate}", f"env.interval_s={b.interval_s}"]
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


async def _decode_batch(url: str, n: int, prompt_tokens: int, max_tokens: int) -> float:
    """Seconds for ``n`` simultaneous non-streaming completions of ``max_tokens`` each."""
    import asyncio

    import httpx

    body = {"model": "tiny-llama", "prompt": [1 + i % 500 for i in range(prompt_tokens)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(n)))
        wall = time.perf_counter() - t0
    bad = [r.status_code for r in answers if r.status_code != 200]
    if bad:
        raise RuntimeError(f"served_decode: {len(bad)} of {n} requests failed ({bad[:3]})")
    return wall


def bench_served_decode(cfg: DictConfig) -> dict[str, Any]:
    """The served path against the calibrated simulator: ``n`` simultaneous requests through a
    real ``vllm serve`` (tiny model), wall seconds per output token, beside the decode step the
    simulator predicts on the calibrated profile (``conf/hardware/cpu_tiny.yaml``, fitted on
    ``engine.step()`` in process). The ratio is what the in-process calibration misses: the
    API server's per-token work on the cores the engine uses (docs/sim_to_real.md)."""
    import asyncio

    import httpx

    from batchpilot.config import load_config
    from batchpilot.core.tiny_model import build_tiny_model
    from batchpilot.envs.specs import HardwareSpec, ModelSpec
    from batchpilot.envs.step_time import StepTimeModel
    from batchpilot.serving.upstream import ManagedVLLM, free_port

    b = cfg.served_decode
    prof = load_config(["model=tiny_llama", f"hardware={b.profile}"])
    st = StepTimeModel.build(HardwareSpec.from_cfg(prof.hardware), ModelSpec.from_cfg(prof.model), "auto", 2048, 256)
    vllm = ManagedVLLM(str(build_tiny_model()), free_port(), served_model_name="tiny-llama", max_model_len=2048,
                       max_num_seqs=256, kv_cache_space_gib=1, extra_args=["--enforce-eager"], log_path=None)
    rows: list[dict[str, Any]] = []
    try:
        vllm.start()
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(vllm.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not vllm.alive():
                raise RuntimeError("served_decode: vllm serve did not become healthy")
            time.sleep(0.5)
        for n in b.warmup:
            asyncio.run(_decode_batch(vllm.url, int(n), int(b.prompt_tokens), int(b.max_tokens)))
        for n in b.concurrencies:
            n = int(n)
            wall = min(asyncio.run(_decode_batch(vllm.url, n, int(b.prompt_tokens), int(b.max_tokens)))
                       for _ in range(int(b.repeats)))
            served = wall / int(b.max_tokens) * 1e3
            ctx = int(b.prompt_tokens) + int(b.max_tokens) / 2
            sim = st.step_time(0, 0.0, 0.0, n, n * ctx, n) * 1e3
            rows.append({"n": n, "served_ms_per_token": round(served, 2), "sim_step_ms": round(sim, 2),
                         "ratio": round(served / sim, 2)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        vllm.stop()
    # Served = a + b * n (least squares): the per-sequence cost the in-process profile lacks.
    n = np.array([r["n"] for r in rows], float)
    extra = np.array([r["served_ms_per_token"] - r["sim_step_ms"] for r in rows])
    slope, icept = np.polyfit(n, extra, 1) if len(rows) > 1 else (float("nan"), float(extra[0]))
    return {"target": "served_decode", "profile": str(b.profile), "rows": rows,
            "extra_ms_per_step": round(float(icept), 3), "extra_ms_per_sequence": round(float(slope), 4)}


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
}


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from batchpilot.schemas import BenchApp, check_app

    check_app(BenchApp, cfg)  # a key added with +key=... (the rest was checked at compose)
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
