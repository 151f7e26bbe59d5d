"""Behaviour of SimEngine: vLLM V1 scheduling semantics, memory, restart, fast-forward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from batchpilot.config import CONF_DIR, load_config
from batchpilot.core.engine import DtypeUnavailable, EngineError, Request, RequestRejected, StepResult, merge_into
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.schemas.engine import SimEngineConfig

# ---- factories (as vLLM's tests/v1/core/utils.py) -------------------------------------------

def _hw(name: str = "h100") -> HardwareSpec:
    return HardwareSpec.from_cfg(OmegaConf.load(CONF_DIR / "hardware" / f"{name}.yaml"))


def _model(name: str = "llama3_8b") -> ModelSpec:
    return ModelSpec.from_cfg(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


def create_engine(hw: str = "h100", model: str = "llama3_8b", **cfg: object) -> SimEngine:
    return SimEngine(_hw(hw), _model(model), SimEngineConfig(**cfg))  # type: ignore[arg-type]


def create_requests(n: int, prompt: int = 100, output: int = 10, t: float = 0.0, prefix: str = "r",
                    hashes: tuple[int, ...] = ()) -> list[Request]:
    return [Request(f"{prefix}{i}", t, prompt, output, prefix_hashes=hashes) for i in range(n)]


def run_all(e: SimEngine, max_steps: int = 100_000) -> StepResult:
    agg = StepResult(start_time=e.now, duration=0.0)
    for _ in range(max_steps):
        r = e.step()
        merge_into(agg, r)
        if r.num_iterations == 0 and not e.stats().num_running and not e.stats().num_waiting:
            break
    return agg


def poisson_workload(seed: int, n: int, rate: float, prompt: float = 1000, output: float = 200) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = np.clip(rng.lognormal(np.log(prompt), 0.6, n), 1, 6000).astype(int)
    o = np.clip(rng.lognormal(np.log(output), 0.6, n), 1, 1500).astype(int)
    return [Request(f"w{i}", float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


# ---- scheduling -----------------------------------------------------------------------------

def test_token_budget_respected_and_chunked_prefill_spans_iterations() -> None:
    e = create_engine(max_num_batched_tokens=512, max_num_seqs=8)
    e.add_request(Request("long", 0.0, 1300, 3))
    sizes = []
    while True:
        r = e.step()
        if r.num_iterations == 0:
            break
        assert r.num_prefill_tokens + r.num_decode_tokens <= 512
        sizes.append(r.num_prefill_tokens)
        if r.first_tokens:
            break
    assert sizes == [512, 512, 276]  # 1300 tokens in three chunks; first token after the last
    assert e.stats().num_running == 1


def test_decode_first_then_prefill_with_leftover_budget() -> None:
    e = create_engine(max_num_batched_tokens=256, max_num_seqs=16)
    for r in create_requests(4, prompt=50, output=20):
        e.add_request(r)
    r = e.step()
    assert r.num_prefill_tokens == 200 and len(r.first_tokens) == 4
    e.add_request(Request("late", e.now, 1000, 5))
    r = e.step()
    # 4 decodes first, then the newcomer gets the remaining 252 tokens of budget.
    assert r.num_decode_tokens == 4 and r.num_prefill_tokens == 252


def test_max_num_seqs_and_set_max_active_cap_running() -> None:
    e = create_engine(max_num_seqs=8)
    for r in create_requests(20, prompt=10, output=50):
        e.add_request(r)
    e.step()
    assert e.stats().num_running == 8
    assert e.set_max_active(3)
    run = run_all(e)
    assert len(run.finished) == 20
    e2 = create_engine(max_num_seqs=8)
    e2.set_max_active(3)
    for r in create_requests(5, prompt=10, output=50):
        e2.add_request(r)
    e2.step()
    assert e2.stats().num_running == 3 and e2.stats().num_waiting == 2


def test_preempts_most_recently_admitted_and_requeues_at_front() -> None:
    # 10 blocks of 16 tokens; three requests of 32-token prompts take 2 blocks each, then grow.
    e = create_engine(num_gpu_blocks_override=10, max_num_seqs=8)
    for r in create_requests(3, prompt=32, output=60):
        e.add_request(r)
    e.add_request(Request("tail", 0.0, 16, 4))
    preempted: list[str] = []
    finished = []
    for _ in range(2000):
        r = e.step()
        preempted += r.preempted
        finished += r.finished
        if r.preempted:
            # Victims are taken from the back of the running order and pushed to the queue front.
            assert e._waiting[0].rid == r.preempted[-1]
        if r.num_iterations == 0 and not e.stats().num_waiting:
            break
    assert preempted and preempted[0] == "tail"
    ids = {f.request_id for f in finished}
    assert ids == {"r0", "r1", "r2", "tail"}  # nothing lost
    by_id = {f.request_id: f for f in finished}
    assert by_id["tail"].num_preemptions >= 1
    assert e.stats().num_preemptions == len(preempted)
    assert e.stats().num_kv_blocks_used == 0


def test_every_request_finishes_under_memory_pressure() -> None:
    e = create_engine(num_gpu_blocks_override=400, max_num_seqs=64, max_num_batched_tokens=2048)
    reqs = poisson_workload(1, 150, rate=50.0, prompt=600, output=120)
    agg = StepResult(start_time=0.0, duration=0.0)
    for r in reqs:
        merge_into(agg, e.advance_until(r.arrival_time))
        e.add_request(r)
    merge_into(agg, e.advance_until(1e9))
    assert sorted(f.request_id for f in agg.finished) == sorted(r.request_id for r in reqs)
    assert agg.preempted, "expected preemptions with 400 blocks"
    for f in agg.finished:
        assert f.arrival_time <= f.first_token_time <= f.finish_time
    assert e.stats().num_kv_blocks_used == 0


def test_prefix_cache_hits_shared_hash_ids() -> None:
    e = create_engine()
    shared = (11, 12, 13)
    e.add_request(Request("a", 0.0, 1600, 2, prefix_hashes=shared + (14,)))
    run_all(e)
    assert e.stats().prefix_cache_hits == 0
    e.add_request(Request("b", e.now, 1600, 2, prefix_hashes=shared + (99,)))
    r = e.step()
    assert r.num_prefill_tokens == 1600 - 3 * 512  # three 512-token blocks reused
    assert e.stats().prefix_cache_hits == 3 * 512
    run_all(e)
    assert e.stats().num_kv_blocks_used == 0


def test_reset_prefix_cache_forgets_blocks_and_frees_them() -> None:
    e = create_engine()
    shared = (11, 12, 13)
    e.add_request(Request("a", 0.0, 1600, 2, prefix_hashes=shared + (14,)))
    run_all(e)
    e.reset_prefix_cache()
    assert e.stats().num_kv_blocks_used == 0
    e.add_request(Request("b", e.now, 1600, 2, prefix_hashes=shared + (99,)))
    assert e.step().num_prefill_tokens == 1600  # nothing reused
    assert e.stats().prefix_cache_hits == 0
    with pytest.raises(EngineError, match="in flight"):
        e.reset_prefix_cache()
    run_all(e)


def test_the_simulator_says_it_does_not_record_iterations() -> None:
    """Only the live engine's iterations are priced against a profile; asking the simulator is
    an error that names it, not an empty log that would read as "no iterations ran"."""
    with pytest.raises(NotImplementedError, match="SimEngine does not record its iterations"):
        create_engine().record_iterations([])


def test_fp8_doubles_kv_blocks_and_memory_model() -> None:
    auto = create_engine()
    fp8 = create_engine(kv_dtype="fp8")
    ratio = fp8.num_kv_blocks_total / auto.num_kv_blocks_total
    assert 1.95 <= ratio <= 2.05
    mm = auto.memory_model()
    assert mm.kv_block_bytes["fp8"] * 2 == mm.kv_block_bytes["auto"]
    assert mm.kv_block_bytes["int8_per_token_head"] > mm.kv_block_bytes["fp8"]  # scales cost bytes
    used = mm.weights_bytes + mm.activation_bytes + mm.num_kv_blocks_total * mm.kv_block_bytes["auto"]
    assert used <= mm.budget_bytes


def test_restart_requeues_in_flight_and_charges_time() -> None:
    e = create_engine()
    for r in create_requests(5, prompt=200, output=100):
        e.add_request(r)
    for _ in range(10):
        e.step()
    t0, blocks0 = e.now, e.num_kv_blocks_total
    cost = e.restart("fp8")
    assert cost == pytest.approx(_model().restart_base_s)
    assert e.now == pytest.approx(t0) and e.down_until == pytest.approx(t0 + cost)
    # Down in engine time: the clock runs, nothing is scheduled until the restart ends.
    res = e.advance_until(t0 + cost / 2)
    assert e.now == pytest.approx(t0 + cost / 2) and res.num_iterations == 0 and not res.finished
    assert e.kv_dtype == "fp8" and e.num_kv_blocks_total > blocks0
    s = e.stats()
    assert s.num_running == 0 and s.num_waiting == 5 and s.num_kv_blocks_used == 0
    assert [q.rid for q in e._waiting] == [f"r{i}" for i in range(5)]  # order kept
    fin = run_all(e).finished
    assert len(fin) == 5 and all(f.num_preemptions == 1 for f in fin)
    assert all(f.first_token_time < t0 for f in fin)  # first tokens came before the restart
    assert all(f.finish_time >= t0 + cost for f in fin)  # and the rest after it


def test_restart_drain_finishes_running_first() -> None:
    e = create_engine(restart_mode="drain")
    for r in create_requests(3, prompt=100, output=20):
        e.add_request(r)
    e.step()
    e.restart("auto")
    r = e.step()
    assert {f.request_id for f in r.finished} == {"r0", "r1", "r2"}
    assert all(f.num_preemptions == 0 for f in r.finished)


def test_unsupported_dtype_raises_and_capabilities_say_why() -> None:
    hw = replace(_hw("a100_80gb"), kv8_dtypes=("int8_per_token_head",), kv8_unavailable_reason="no fp8 here")
    e = SimEngine(hw, _model(), SimEngineConfig())
    caps = e.capabilities()
    assert caps.can_run("int8_per_token_head") and caps.can_run("auto")
    assert "no fp8 here" in (caps.why_not("fp8") or "")
    e.add_request(Request("x", 0.0, 10, 5))
    e.step()
    with pytest.raises(DtypeUnavailable, match="fp8"):
        e.restart("fp8")
    assert e.stats().num_running == 1 and e.kv_dtype == "auto"  # untouched


def test_rejects_too_long_prompt_and_clips_output() -> None:
    e = create_engine()
    with pytest.raises(RequestRejected) as ei:
        e.add_request(Request("big", 0.0, 8193, 10))
    assert ei.value.reason == "prompt_too_long"
    e.add_request(Request("edge", 0.0, 8000, 1000))
    fin = run_all(e).finished
    assert fin[0].output_len == 192  # clipped at max_model_len like vLLM


def _drive(e: SimEngine, reqs: list[Request], use_advance: bool) -> dict[str, tuple[float, float, int]]:
    out = {}
    for r in reqs + [None]:  # type: ignore[list-item]
        t = r.arrival_time if r is not None else 1e12
        if use_advance:
            res = e.advance_until(t)
            out.update({f.request_id: (f.first_token_time, f.finish_time, f.num_preemptions) for f in res.finished})
        else:
            while e.now < t:
                s = e.step()
                out.update({f.request_id: (f.first_token_time, f.finish_time, f.num_preemptions) for f in s.finished})
                if s.num_iterations == 0 and not s.preempted:
                    e.idle_until(t)
        if r is not None:
            e.add_request(r)
    return out


@pytest.mark.parametrize("blocks", [None, 1500])
def test_step_loop_equals_advance_until(blocks: int | None) -> None:
    reqs = poisson_workload(7, 300, rate=12.0)
    a = _drive(create_engine(num_gpu_blocks_override=blocks), reqs, use_advance=False)
    b = _drive(create_engine(num_gpu_blocks_override=blocks), reqs, use_advance=True)
    assert a.keys() == b.keys() == {r.request_id for r in reqs}
    for k in a:
        assert b[k][0] == pytest.approx(a[k][0], rel=1e-9)
        assert b[k][1] == pytest.approx(a[k][1], rel=1e-9)
        assert b[k][2] == a[k][2]


def test_stop_on_finish_stops_after_first_finishing_iteration() -> None:
    e = create_engine()
    e.add_request(Request("a", 0.0, 100, 50))
    e.add_request(Request("b", 0.0, 100, 500))
    r = e.advance_until(1e9, stop_on_finish=True)
    assert [f.request_id for f in r.finished] == ["a"]
    assert r.num_iterations == 50 and e.now == r.finished[0].finish_time


def test_deterministic() -> None:
    reqs = poisson_workload(3, 200, rate=20.0)
    a = _drive(create_engine(num_gpu_blocks_override=2000), reqs, True)
    b = _drive(create_engine(num_gpu_blocks_override=2000), reqs, True)
    assert a == b


def test_hydra_composition_deepseek_on_h200_fits_128k_context() -> None:
    cfg = load_config(["hardware=h200", "model=deepseek_v3"])
    e = SimEngine.from_cfg(cfg)
    assert e.num_kv_blocks_total * e.cfg.block_size >= 131072
    e.add_request(Request("long", 0.0, 131000, 8))
    fin = run_all(e).finished
    assert fin and fin[0].ttft > 0


def test_70b_does_not_fit_a100_40gb_with_clear_error() -> None:
    with pytest.raises(ValueError, match="tensor_parallel"):
        create_engine("a100_40gb", "llama3_70b")
    assert create_engine("a100_40gb", "llama3_70b_tp8").num_kv_blocks_total > 0


# ---- ingress latency ------------------------------------------------------------------------

def test_a_request_reaches_the_scheduler_after_the_ingress_latency() -> None:
    lat = 0.004
    plain, late = create_engine(), create_engine(ingress_latency_s=lat)
    for e in (plain, late):
        e.add_request(Request("a", 0.0, 100, 3))
    assert late.stats().num_waiting == 1  # on its way in: counted as waiting
    assert late.advance_until(lat / 2).num_iterations == 0 and late.now == pytest.approx(lat / 2)
    a = plain.advance_until(1.0, stop_on_first_token=True).first_tokens[0][2]
    b = late.advance_until(1.0, stop_on_first_token=True).first_tokens[0][2]
    assert b == pytest.approx(a + lat, rel=1e-9)
    c = create_engine(ingress_latency_s=lat)
    c.add_request(Request("a", 0.0, 100, 3))
    assert c.step().first_tokens[0][2] == pytest.approx(b, rel=1e-9)  # step() waits for it too


def test_fast_forward_stops_for_a_request_on_its_way_in() -> None:
    """A request added while others decode joins the first iteration that starts once it is in,
    whether the decode stretch is summed in closed form or stepped."""
    def first_token(use_advance: bool) -> float:
        e = create_engine(ingress_latency_s=0.05)
        e.add_request(Request("long", 0.0, 100, 5000))
        e.advance_until(0.5)
        e.add_request(Request("new", e.now, 100, 3))
        if use_advance:
            return e.advance_until(10.0, stop_on_first_token=True).first_tokens[0][2]
        while True:
            r = e.step()
            if r.first_tokens:
                return r.first_tokens[0][2]

    assert first_token(True) == pytest.approx(first_token(False), rel=1e-9)


@pytest.mark.parametrize("lat", [0.0, 0.002])
def test_feeding_on_first_tokens_leaves_decode_only_iterations_only_with_a_latency(lat: float) -> None:
    """A gateway that sends the next prompt when the last one's first token comes back: with no
    latency the engine never runs an iteration without prefill; with any, it runs one between."""
    e = create_engine(ingress_latency_s=lat, max_num_batched_tokens=2048)
    for r in create_requests(8, prompt=50, output=2000, prefix="d"):
        e.add_request(r)
    e.advance_until(1.0)  # eight decoders running
    n_decode_only, fed = 0, 0
    e.add_request(Request("p0", e.now, 2000, 5))
    while fed < 20:
        r = e.step()
        n_decode_only += r.num_prefill_tokens == 0
        if r.first_tokens:
            fed += 1
            e.add_request(Request(f"p{fed}", e.now, 2000, 5))
    assert (n_decode_only > 0) == (lat > 0)
    if lat > 0:
        assert n_decode_only >= fed - 1  # about one per prompt fed


def test_ingress_latency_must_be_a_finite_non_negative_time() -> None:
    for bad in (-0.001, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ingress_latency_s"):
            SimEngineConfig(ingress_latency_s=bad)
