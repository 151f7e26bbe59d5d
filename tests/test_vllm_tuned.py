"""vLLM's own admission in the simulator and the ``vllm_tuned`` controller (issue 53, part 1).

- The simulated API server's limits decide as vLLM 0.32's ``AsyncLLM.check_admission`` does
  (the installed vLLM's own function is the reference), ``SimEngine`` enforces them and
  ``max_num_active_seqs``, and an evaluation counts a refusal as a rejected request.
- ``VllmServerEnv`` has no batchpilot admission gate, shield or breaker.
- ``vllm_tuned`` sweeps vLLM's flags on the tuning seeds, is reported with its hindsight bound,
  runs on a trace the project never saw, and gives the same files serially and on Ray.
- Live: a burst sent at once to a real ``vllm serve`` started with ``--max-num-queued-reqs`` /
  ``--max-num-queued-tokens`` (tiny model) and to the simulator with the same flags gets the same
  number of 503s, within two requests.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from batchpilot.config import CONF_DIR, load_config
from batchpilot.core.engine import Request, RequestRejected
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.envs.api_server import API_SERVER_503, QueueLimits
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.evaluation.matrix import evaluate
from batchpilot.evaluation.plan import EvalConfig, EvaluationError, compose_eval
from batchpilot.schemas.engine import SimEngineConfig


def _engine(hw: str = "h100", model: str = "llama3_8b", **cfg: object) -> SimEngine:
    return SimEngine(HardwareSpec.from_cfg(OmegaConf.load(CONF_DIR / "hardware" / f"{hw}.yaml")),
                     ModelSpec.from_cfg(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml")),
                     SimEngineConfig(**cfg))  # type: ignore[arg-type]


def _burst(engine: SimEngine, n: int, prompt: int, output: int, prefix: str = "b") -> list[str]:
    """Add ``n`` requests at the engine's present moment; the reasons of those refused."""
    reasons = []
    for i in range(n):
        try:
            engine.add_request(Request(f"{prefix}{i}", engine.now, prompt, output))
        except RequestRejected as e:
            reasons.append(e.reason)
    return reasons


def _drain(engine: SimEngine) -> None:
    while engine.num_running or engine.num_waiting:
        engine.step()


# --- the limits, against vLLM's own check ------------------------------------------------------
@pytest.mark.slow  # imports vLLM (seconds)
def test_queue_limits_decide_as_vllms_check_admission() -> None:
    """``QueueLimits.refusal`` against the installed vLLM's ``AsyncLLM.check_admission`` on the
    same counts: every combination of limits (none, 0, small), counts around them and ``n``."""
    pytest.importorskip("vllm")
    from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError
    from vllm.v1.engine.async_llm import AsyncLLM

    def vllm_says(reqs: int | None, toks: int | None, unfinished: int, queued: int, n: int) -> str | None:
        fake = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_queued_reqs=reqs, max_num_queued_tokens=toks),
            admission_stats=None, get_num_unfinished_requests=lambda: unfinished,
            get_num_queued_tokens=lambda: queued, _record_admission_rejection=lambda reason: None)
        try:
            AsyncLLM.check_admission(fake, n)  # type: ignore[arg-type]
        except QueueOverflowError as e:
            assert e.message == API_SERVER_503["max_num_queued_reqs"] and e.http_status == 503
            return "max_num_queued_reqs"
        except MaxQueuedTokensError as e:
            assert e.message == API_SERVER_503["max_num_queued_tokens"] and e.http_status == 503
            return "max_num_queued_tokens"
        return None

    checked = refused = 0
    for reqs in (None, 0, 1, 4):
        for toks in (None, 0, 100, 1000):
            limits = QueueLimits(reqs, toks)
            for unfinished in range(7):
                for queued in (0, 99, 100, 101, 999, 1000, 5000):
                    for n in (1, 2):
                        want = vllm_says(reqs, toks, unfinished, queued, n)
                        assert limits.refusal(unfinished, queued, n) == want, (reqs, toks, unfinished, queued, n)
                        checked += 1
                        refused += want is not None
    assert checked == 4 * 4 * 7 * 7 * 2 and 0 < refused < checked


def test_engine_config_checks_the_flags_as_vllm_does() -> None:
    with pytest.raises(ValueError, match=r"engine.max_num_active_seqs=300 is invalid: must be in \[1, max_num_seqs=256\]"):
        SimEngineConfig(max_num_active_seqs=300)
    with pytest.raises(ValueError, match=r"engine.max_num_queued_tokens=-1 is invalid: must be >= 0"):
        SimEngineConfig(max_num_queued_tokens=-1)
    assert SimEngine.from_cfg(load_config()).cfg.max_num_queued_reqs is None  # conf/engine/sim.yaml: no limit


# --- SimEngine enforces them ------------------------------------------------------------------
def test_max_num_queued_reqs_counts_running_and_waiting_until_they_finish() -> None:
    e = _engine(max_num_seqs=4, max_num_queued_reqs=10)
    assert _burst(e, 14, 200, 50) == ["max_num_queued_reqs"] * 4  # 10 in flight: 4 run, 6 wait
    assert (e.num_unfinished, e.num_running + e.num_waiting) == (10, 10)
    while e.num_unfinished == 10:  # nothing else is refused until one finishes
        e.step()
    free = 10 - e.num_unfinished  # the first 4 finish together
    assert free == 4 and _burst(e, free + 1, 200, 50, "late") == ["max_num_queued_reqs"]  # the slots freed: taken
    _drain(e)
    assert e.num_unfinished == 0 and _burst(e, 10, 200, 50, "again") == []


def test_max_num_queued_tokens_counts_prompts_until_their_first_token() -> None:
    """Refused while the prompts without a first token reach the limit; the arriving prompt's own
    tokens are not counted (one prompt over the limit is taken when nothing is queued)."""
    e = _engine(max_num_seqs=1, max_num_queued_tokens=2500)
    assert _burst(e, 5, 1000, 400) == ["max_num_queued_tokens"] * 2  # backlog 0, 1000, 2000: taken
    assert e.num_queued_tokens == 3000
    while e.num_queued_tokens == 3000:  # the first request's first token: its prompt leaves
        e.step()
    assert e.num_queued_tokens == 2000 and _burst(e, 2, 1000, 400, "more") == ["max_num_queued_tokens"]
    _drain(e)
    assert e.num_queued_tokens == 0
    assert _burst(e, 1, 6000, 10, "long") == []  # alone, over the limit: taken, as vLLM does
    assert _burst(e, 1, 10, 10, "short") == ["max_num_queued_tokens"]


def test_refused_requests_leave_no_trace_and_preempted_ones_stay_counted() -> None:
    """A refusal takes nothing (the same id may come again); a request preempted after its first
    token stays unfinished but out of the token backlog, as in vLLM's API server."""
    e = _engine("cpu_tiny", "tiny_llama", max_num_seqs=8, max_num_batched_tokens=2048, num_gpu_blocks_override=40,
                block_size=16, max_num_queued_reqs=6)
    assert _burst(e, 8, 100, 300) == ["max_num_queued_reqs"] * 2
    assert _burst(e, 1, 100, 300, "b6") == ["max_num_queued_reqs"]  # b6 refused before: its id is free
    preempted = 0
    while e.num_unfinished:
        res = e.step()
        preempted += len(res.preempted)
        assert e.num_queued_tokens >= 0
    assert preempted > 0 and e.num_queued_tokens == 0


def test_max_num_active_seqs_caps_the_running_batch_whatever_set_max_active_asks() -> None:
    e = _engine(max_num_seqs=16, max_num_active_seqs=3)
    e.set_max_active(16)
    _burst(e, 10, 100, 100)
    seen = 0
    while e.num_running or e.num_waiting:
        e.step()
        seen = max(seen, e.num_running)
    assert seen == 3
    assert e.capabilities().max_num_seqs == 16  # the runner's size is max_num_seqs, as in vLLM


# --- the server environment -------------------------------------------------------------------
def test_server_env_has_no_gate_no_shield_and_counts_refusals_as_rejections() -> None:
    """vLLM alone: every arrival reaches the engine at once (admission never holds one), the
    shield never intervenes, and each 503 of the API server is a rejected request."""
    from batchpilot.core.control import PassThroughShield
    from batchpilot.core.knobs import Proposal
    from batchpilot.envs.server_env import VllmServerEnv

    cfg = load_config(["workload=poisson", "workload.duration_s=20", "workload.rate=60", "env.episode_s=20",
                       "env.drain_on_truncate=true"])
    env = VllmServerEnv(cfg, engine={"max_num_seqs": 32, "max_num_queued_reqs": 48})
    env.reset(seed=0)
    assert isinstance(env.shield, PassThroughShield) and env.engine.cfg.max_num_queued_reqs == 48
    assert env.cfg.engine.max_num_queued_reqs is None  # the shared deployment keeps no server flag
    held = 0
    while True:
        _, _, term, trunc, info = env.step_proposal(Proposal(batch_cap=512))  # a huge cap: passed as is
        held = max(held, env.admission.num_waiting)
        assert env.engine.num_running <= 32 and env.engine.num_unfinished <= 48
        if term or trunc:
            break
    m = info["episode_metrics"]
    assert held == 0 and m["shield_interventions"] == 0 and env.knobs.batch_cap == 512
    assert m["rejected"] > 0 and m["rejected"] + m["completed"] == len(env.stream)
    assert {getattr(r, "reason", None) for r in env._rejections} == {"max_num_queued_reqs"}


def test_vllm_alone_takes_none_of_batchpilots_refusals_under_the_refuse_presets() -> None:
    """``env=refuse_early`` is batchpilot's admission; vLLM's paths (``vllm_tuned``, vLLM as
    shipped) refuse on their queue limits only. Before, early refusal leaked into both."""
    from batchpilot.envs.server_env import VllmServerEnv
    from batchpilot.evaluation.matrix import episode_config

    cfg = load_config(["env=refuse_early", "workload=poisson", "workload.duration_s=20", "workload.rate=60",
                       "env.episode_s=20", "env.drain_on_truncate=true"])
    assert cfg.env.admission.early_refusal and cfg.env.admission.ttft_deadline  # the preset refuses
    env = VllmServerEnv(cfg, engine={"max_num_seqs": 32})
    a = env.admission.cfg
    assert not a.early_refusal and not a.ttft_deadline
    plan = SimpleNamespace(cfg=cfg, episode_s=20.0, max_num_seqs=32)
    shipped = episode_config(plan, None, as_shipped=True)  # type: ignore[arg-type]
    assert not shipped.env.admission.early_refusal and not shipped.env.admission.ttft_deadline


# --- vllm_tuned in the evaluation ---------------------------------------------------------------
#: A loaded Poisson window and a 4-point grid (2 seqs x no limit / the docs' rule).
SMALL = ["workload=poisson", "workload.duration_s=20", "workload.rate=60", "seeds=[0,1]", "logger=none",
         "plots=false", "best_static.tune_seeds=[5]", "+policy_overrides.vllm_tuned.max_num_seqs=[32,256]",
         "+policy_overrides.vllm_tuned.max_num_batched_tokens=[8192]",
         "+policy_overrides.vllm_tuned.queued_tokens_ttft_factors=[1.0]"]


def _run(out: Path, extra: list[str], base: list[str] = SMALL) -> list[dict]:
    overrides = [*base, f"out_dir={out}", *extra]
    cfg, _ = compose_eval(overrides)
    return evaluate(cfg, overrides)


def test_vllm_tuned_is_swept_on_the_tuning_seed_and_bounded_by_its_hindsight(tmp_path: Path) -> None:
    rows = _run(tmp_path, ["policies=[vllm_tuned,vllm_default]"])
    names = [r["policy"] for r in rows]
    assert names == ["vllm_tuned"] * 2 + ["vllm_tuned_hindsight"] * 2 + ["vllm_default"] * 2
    search = json.loads((tmp_path / "vllm_tuned_search.json").read_text())
    assert len(search) == 4 and sum(p["chosen"] for p in search) == 1 == sum(p["hindsight_chosen"] for p in search)
    rule = [p for p in search if p["ttft_factor"] == 1.0]
    assert len(rule) == 2 and all(p["max_num_queued_tokens"] == round(p["prefill_tokens_per_s"]) for p in rule)
    chosen = next(p for p in search if p["chosen"])
    # The pick is the objective's on the tuning seed's means, not the scored seeds'.
    ok = [p for p in search if p["slo_attainment"] >= 0.9] or search
    assert chosen["request_goodput"] == max(p["request_goodput"] for p in ok) or not [
        p for p in search if p["slo_attainment"] >= 0.9]
    by = {(r["policy"], r["seed"]): r for r in rows}
    assert by[("vllm_tuned", 0)]["knobs"].startswith(f"--max-num-seqs {chosen['max_num_seqs']} ")
    # vLLM alone: never a shield intervention; the defaults refuse nothing, a queue limit may.
    assert all(r["shield_interventions"] == 0 for r in rows)
    assert by[("vllm_default", 0)]["rejected"] == 0
    # The cell's capacity bound is the deployment's, whatever flags a server runs with.
    for seed in (0, 1):
        if "slo_capacity" in by[("vllm_tuned", seed)]:
            assert by[("vllm_tuned", seed)]["slo_capacity"] == by[("vllm_default", seed)]["slo_capacity"]
    bound = [r["request_goodput"] for r in rows if r["policy"] == "vllm_tuned_hindsight"]
    tuned = [r["request_goodput"] for r in rows if r["policy"] == "vllm_tuned"]
    assert np.mean(bound) >= np.mean(tuned) - 1e-9
    md = (tmp_path / "results.md").read_text()
    assert "- vllm_tuned on poisson: --max-num-seqs" in md and "tuning seeds [5]" in md


def test_vllm_tuned_is_tuned_on_seeds_apart_from_the_scored_ones() -> None:
    cfg, _ = compose_eval([*SMALL, "policies=[vllm_tuned,pid]", "best_static.tune_seeds=[1]"])
    with pytest.raises(EvaluationError, match=r"tune_seeds \[1\] overlap seeds \[0, 1\] at \[1\]: vllm_tuned must"):
        EvalConfig.from_cfg(cfg)
    cfg, _ = compose_eval([*SMALL, "policies=[vllm_tuned,pid]"])
    ecfg = EvalConfig.from_cfg(cfg)
    assert ecfg.tuned == ("vllm_tuned",) and ecfg.all_seeds == (0, 1, 5)


def test_a_bad_grid_is_one_error_before_any_episode(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"policy 'vllm_tuned': .*max_num_seqs must be non-empty"):
        _run(tmp_path, ["policies=[vllm_tuned]", "+policy_overrides.vllm_tuned.max_num_seqs=[]"])
    with pytest.raises(EvaluationError, match=r"no setting of the grid runs here .*needs max_num_batched_tokens >= "):
        _run(tmp_path, ["policies=[vllm_tuned]", "+policy_overrides.vllm_tuned.max_num_batched_tokens=[16]"])
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_vllm_tuned_runs_on_a_trace_the_project_never_saw(tmp_path: Path) -> None:
    """``workload=trace`` with a file written here (Azure format): vllm_tuned tunes on its
    window 2 and is scored on windows 0 and 1 beside vLLM as shipped and PID."""
    rng = np.random.default_rng(7)
    t = np.cumsum(rng.exponential(1 / 25.0, 3000))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for s, p, o in zip(t, rng.integers(50, 3000, len(t)), rng.integers(5, 400, len(t))):
        whole = int(s)
        lines.append(f"2024-05-10 00:{whole // 60:02d}:{whole % 60:02d}.{int((s - whole) * 1e7):07d},{p},{o}")
    trace = tmp_path / "never_seen.csv"
    trace.write_text("\n".join(lines) + "\n")
    base = [o for o in SMALL if not o.startswith("workload")]
    rows = _run(tmp_path / "out", ["workload=trace", f"workload.path={trace}", "workload.format=azure",
                                   "workload.duration_s=30", "best_static.tune_seeds=[2]",
                                   "policies=[vllm_tuned,vllm_default,pid]"], base)
    assert {r["workload"] for r in rows} == {"trace:never_seen"}
    assert [r["window_start_s"] for r in rows if r["policy"] == "vllm_tuned"] == [0.0, 30.0]
    assert {r["policy"] for r in rows} == {"vllm_tuned", "vllm_tuned_hindsight", "vllm_default", "pid"}
    assert all(r["completed"] + r["rejected"] > 0 and math.isfinite(r["request_goodput"]) for r in rows)


@pytest.mark.slow  # a local Ray cluster (seconds)
def test_vllm_tuned_on_ray_gives_the_serial_rows(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import ray

    extra = ["policies=[vllm_tuned]", "seeds=[0]"]
    serial = _run(tmp_path / "serial", extra)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        on_ray = _run(tmp_path / "ray", [*extra, "launcher=ray"])
    finally:
        ray.shutdown()
    assert len(on_ray) == len(serial) == 2  # vllm_tuned and its bound, one seed
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("serial", "ray"))  # NaN as null
    assert [{k: v for k, v in r.items() if k != "wall_s"} for r in b] == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in a]
    for name in ("vllm_tuned_search.json", "results.md"):
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes()


# --- live: the simulated API server refuses what vllm serve refuses ---------------------------------
#: The server's flags (and the simulator's): one request runs at a time, so a burst's requests
#: stay unfinished, and their prompts wait without a first token, while the burst arrives.
LIVE_FLAGS = {"max_num_seqs": 1, "max_num_queued_reqs": 12, "max_num_queued_tokens": 1000}
#: (requests, prompt tokens, output tokens) of each burst: the first meets the request limit (20
#: short prompts, 12 taken), the second, once the first has finished, the token limit (10 prompts
#: of 300 tokens: backlogs 0, 300, 600, 900 are below 1000, so 4 are taken).
BURSTS = ((20, 20, 128), (10, 300, 128))


async def _send_burst(url: str, model: str, n: int, prompt: int, output: int) -> list[tuple[int, str]]:
    """``n`` completions sent at once (prompts as token ids: no tokenizer in the way); each
    answer's status and, for an error, its message."""
    import asyncio

    import httpx

    body = {"model": model, "max_tokens": output, "ignore_eos": True, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> tuple[int, str]:
            ids = [(7 * i + k) % 900 + 50 for k in range(prompt)]
            r = await client.post("/v1/completions", json={**body, "prompt": ids})
            return r.status_code, "" if r.status_code == 200 else json.dumps(r.json())

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _sim_refusals() -> list[list[str]]:
    """The same bursts at the simulated server (the tiny model on this CPU's profile, the same
    flags): each arrives at once, and the next after the last has finished."""
    e = _engine("cpu_tiny", "tiny_llama", block_size=32, max_num_batched_tokens=2048, **LIVE_FLAGS)
    out = []
    for k, (n, prompt, output) in enumerate(BURSTS):
        out.append(_burst(e, n, prompt, output, prefix=f"burst{k}-"))
        _drain(e)
    return out


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_burst_gets_as_many_503s_from_vllm_serve_as_from_the_simulator(tiny_model_path: Path, tmp_path: Path) -> None:
    """A real ``vllm serve`` (tiny model) started with ``--max-num-queued-reqs`` and
    ``--max-num-queued-tokens``, and the simulator with the same flags, each sent the same two
    bursts: the same number of 503s per burst within two requests (a real server checks a
    request before registering it, with awaits between, so a burst's requests may slip past
    together; and its first request's first token may come before the burst's last arrives),
    each 503 with the message of the limit that refused it, counted by vLLM's own counter."""
    import asyncio

    import httpx
    from gateway_helpers import wait_until

    from batchpilot.serving.upstream import ManagedVLLM, free_port

    sim = _sim_refusals()
    assert [len(r) for r in sim] == [8, 6]
    assert sim == [["max_num_queued_reqs"] * 8, ["max_num_queued_tokens"] * 6]
    log = tmp_path / "vllm.log"
    flags = ["--max-num-queued-reqs", str(LIVE_FLAGS["max_num_queued_reqs"]),
             "--max-num-queued-tokens", str(LIVE_FLAGS["max_num_queued_tokens"]), "--enforce-eager"]
    server = ManagedVLLM(str(tiny_model_path), free_port(), served_model_name="tiny", max_model_len=2048,
                         max_num_seqs=LIVE_FLAGS["max_num_seqs"], kv_cache_space_gib=1, extra_args=flags,
                         log_path=log)
    server.start()
    try:
        def up() -> bool:
            assert server.alive(), f"vllm serve exited during start-up; see {log}"
            try:
                return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 600, f"vllm serve on {server.url} healthy (log: {log})", poll_s=1.0)
        answers = [asyncio.run(_send_burst(server.url, "tiny", *burst)) for burst in BURSTS]
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.close()
    for (n, _, _), got, want, reason in zip(BURSTS, answers, sim, ("max_num_queued_reqs", "max_num_queued_tokens")):
        refused = [msg for status, msg in got if status == 503]
        assert all(status in (200, 503) for status, _ in got), got
        print(f"burst of {n}: vllm serve refused {len(refused)}, the simulator {len(want)}")
        assert abs(len(refused) - len(want)) <= 2, (len(refused), len(want))
        assert refused and all(API_SERVER_503[reason] in msg for msg in refused), refused[:2]
    counted = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'^vllm:admission_rejections_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', metrics, re.M)}
    assert counted == {"max_num_queued_reqs": sum(s == 503 for s, _ in answers[0]),
                       "max_num_queued_tokens": sum(s == 503 for s, _ in answers[1])}, counted
