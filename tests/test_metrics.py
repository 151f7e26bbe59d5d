"""Metrics: summaries of hand-built requests match numbers computed independently here, and
vLLM's /metrics text parses under both old and new names."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.engine import FinishedRequest
from batchpilot.core.telemetry import SLO
from batchpilot.metrics import SUMMARY_KEYS, VLLM_METRIC_NAMES, Offered, parse_vllm_metrics, summarize


def fr(i: int, arrival: float, first: float, finish: float, prompt: int, output: int, itl=None):
    return FinishedRequest(f"r{i}", arrival, first, finish, prompt, output, itl=itl)


# Four requests; times in seconds.
REQS = [
    fr(0, 0.0, 0.2, 2.2, 100, 21),   # ttft 0.2, tpot 0.1, e2el 2.2
    fr(1, 1.0, 1.5, 1.5, 50, 1),     # ttft 0.5, single token: tpot 0, e2el 0.5
    fr(2, 2.0, 4.0, 8.0, 400, 41),   # ttft 2.0 (misses 1 s TTFT), tpot 0.1, e2el 6.0
    fr(3, 3.0, 3.1, 9.1, 10, 31),    # ttft 0.1, tpot 0.2 (misses 100 ms TPOT), e2el 6.1
]


def test_summary_matches_hand_computation():
    s = summarize(REQS, duration_s=10.0, slo=SLO(ttft_ms=1000, tpot_ms=100), num_rejected=1)
    assert list(s)[: len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
    assert s["completed"] == 4 and s["rejected"] == 1
    assert s["total_input_tokens"] == 560 and s["total_output_tokens"] == 94
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(9.4)
    assert s["total_token_throughput"] == pytest.approx(65.4)
    # r0 and r1 meet both objectives; r2 misses TTFT, r3 misses TPOT.
    assert s["request_goodput"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # the rejected one is a miss

    ttft = np.array([200.0, 500.0, 2000.0, 100.0])
    assert s["mean_ttft_ms"] == pytest.approx(700.0)
    assert s["median_ttft_ms"] == pytest.approx(350.0)
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99))
    # TPOT over requests with more than one output token (as vllm bench).
    assert s["mean_tpot_ms"] == pytest.approx((100 + 100 + 200) / 3)
    assert s["median_tpot_ms"] == pytest.approx(100.0)
    # ITL without per-token timings: each request's TPOT for each of its gaps (20, 40, 30).
    itl = np.repeat([100.0, 100.0, 200.0], [20, 40, 30])
    assert s["mean_itl_ms"] == pytest.approx(itl.mean())  # 133.33, unlike mean TPOT
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["p99_itl_ms"] == pytest.approx(200.0)
    assert s["mean_e2el_ms"] == pytest.approx((2200 + 500 + 6000 + 6100) / 4)
    assert s["p99_e2el_ms"] == pytest.approx(np.percentile([2200, 500, 6000, 6100], 99))


def test_goodput_is_over_the_arrival_window_and_attainment_over_offered_requests():
    """The same four completions, one refusal and one request still open, offered over an 8 s
    window and drained until 10 s: goodput over the 8 s, attainment over all six offered (the
    refused and the open one are misses), the old views under their own names."""
    offered = Offered(np.array([100, 50, 400, 10, 2000, 9000]), np.array([21, 1, 41, 31, 10, 10]))
    s = summarize(REQS, 10.0, SLO(ttft_ms=1000, tpot_ms=100), num_rejected=1, window_s=8.0, offered=offered)
    assert s["request_goodput"] == pytest.approx(2 / 8.0)  # r0 and r1 over the window
    assert s["request_goodput_run"] == pytest.approx(2 / 10.0)  # vllm bench serve's: drain included
    assert s["request_throughput"] == pytest.approx(0.4)  # throughputs stay over the run
    assert s["offered"] == 6 and s["window_s"] == 8.0
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["slo_attainment_completed"] == pytest.approx(2 / 4)
    assert s["refusal_rate"] == pytest.approx(1 / 6)
    # Buckets at 1024 / 8192: short = the four served ones (r0, r1 met), medium = the 2000-token
    # refused one, long = the open 9000-token one.
    assert s["slo_attainment_short"] == pytest.approx(2 / 4)
    assert s["slo_attainment_medium"] == 0.0 and s["slo_attainment_long"] == 0.0
    tokens = (100 + 21) + (50 + 1)
    assert s["slo_attainment_tokens"] == pytest.approx(tokens / (560 + 94 + 2010 + 9010))


def test_offered_fewer_than_served_is_an_error_and_buckets_without_offers_are_nan():
    with pytest.raises(ValueError, match="exceed the 3 offered"):
        summarize(REQS, 10.0, SLO(), offered=Offered(np.array([1, 2, 3]), np.array([1, 1, 1])))
    s = summarize(REQS, 10.0, SLO(), offered=Offered(np.array([100, 50, 400, 10]), np.array([21, 1, 41, 31])))
    assert math.isnan(s["slo_attainment_medium"]) and math.isnan(s["slo_attainment_long"])
    plain = summarize(REQS, 10.0, SLO())  # without offered requests: no bucket, no token figure
    assert math.isnan(plain["slo_attainment_short"]) and math.isnan(plain["slo_attainment_tokens"])
    assert plain["window_s"] == 10.0 and plain["offered"] == 4
    with pytest.raises(ValueError, match="window_s"):
        summarize(REQS, 10.0, SLO(), window_s=0.0)


def test_itl_uses_per_token_timings_when_present():
    reqs = [
        fr(0, 0.0, 0.1, 0.4, 10, 4, itl=(0.05, 0.05, 0.2)),
        fr(1, 0.0, 0.1, 1.1, 10, 11),  # no per-token timings: 10 gaps of 0.1
    ]
    s = summarize(reqs, 2.0, SLO())
    expected = np.array([50.0, 50.0, 200.0] + [100.0] * 10)
    assert s["mean_itl_ms"] == pytest.approx(expected.mean())
    assert s["median_itl_ms"] == pytest.approx(np.median(expected))
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(expected, 99))


def test_e2el_slo_and_no_slo():
    s = summarize(REQS, 10.0, SLO(ttft_ms=None, tpot_ms=None, e2el_ms=2500))
    assert s["request_goodput"] == pytest.approx(0.2)  # r0 (2.2 s) and r1 (0.5 s)
    s = summarize(REQS, 10.0, SLO(ttft_ms=None, tpot_ms=None, e2el_ms=None))
    assert s["slo_attainment"] == 1.0 and s["request_goodput"] == pytest.approx(0.4)


def test_empty_run_gives_nan_latencies_not_zero():
    s = summarize([], 5.0, SLO(), num_rejected=3)
    assert s["completed"] == 0 and s["request_throughput"] == 0
    assert s["slo_attainment"] == 0.0 and s["request_goodput"] == 0.0 and s["refusal_rate"] == 1.0
    assert math.isnan(s["p99_ttft_ms"]) and math.isnan(s["mean_itl_ms"])
    assert math.isnan(summarize([], 5.0, SLO())["slo_attainment"])


def test_extra_is_appended_and_cannot_overwrite():
    s = summarize(REQS, 10.0, SLO(), extra={"num_preemptions": 7})
    assert s["num_preemptions"] == 7.0
    with pytest.raises(ValueError, match="request_goodput"):
        summarize(REQS, 10.0, SLO(), extra={"request_goodput": 1.0})


def test_bad_duration_rejected():
    with pytest.raises(ValueError, match="duration_s"):
        summarize(REQS, 0.0, SLO())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.001, 5.0), st.floats(0.001, 2.0), st.integers(1, 60)),
        min_size=1, max_size=25,
    )
)
def test_itl_stats_equal_expanded_numpy(rows):
    """The weighted statistics equal numpy's on the fully expanded per-token list."""
    reqs = [fr(i, 0.0, ttft, ttft + tpot * (n - 1), 10, n) for i, (ttft, tpot, n) in enumerate(rows)]
    s = summarize(reqs, 1.0, SLO())
    expanded = np.concatenate([np.full(r.output_len - 1, r.tpot * 1e3) for r in reqs])
    if expanded.size == 0:
        assert math.isnan(s["median_itl_ms"])
        return
    assert s["mean_itl_ms"] == pytest.approx(expanded.mean(), rel=1e-9)
    assert s["median_itl_ms"] == pytest.approx(np.median(expanded), rel=1e-9)
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(expanded, 99), rel=1e-9)


# --- Prometheus ----------------------------------------------------------------------------------
NEW = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 12.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 9.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.25
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.8
"""

OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 2.0
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 64.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 16.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_per_output_token_seconds_count{model_name="m"} 10.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.3
"""


def test_parse_new_names():
    m = parse_vllm_metrics(NEW)
    assert m["num_running"] == 15.0  # summed over engines
    assert m["num_waiting"] == 4.0
    assert m["kv_cache_usage"] == pytest.approx(0.375)  # averaged over engines
    assert m["num_preemptions"] == 9.0
    assert m["prefix_cache_queries"] == 1000.0 and m["prefix_cache_hits"] == 250.0
    assert m["ttft_seconds_count"] == 5.0 and m["ttft_seconds_sum"] == 1.25
    assert m["itl_seconds_count"] == 40.0 and m["itl_seconds_sum"] == pytest.approx(0.8)
    assert "e2el_seconds_count" not in m  # not exposed -> absent, not 0


def test_parse_old_names_into_same_keys():
    m = parse_vllm_metrics(OLD)
    assert m["num_running"] == 7.0 and m["num_waiting"] == 0.0
    assert m["kv_cache_usage"] == pytest.approx(0.9)
    assert m["num_preemptions"] == 2.0
    assert m["prefix_cache_queries"] == 64.0 and m["prefix_cache_hits"] == 16.0
    assert m["itl_seconds_count"] == 10.0 and m["itl_seconds_sum"] == pytest.approx(0.3)


def test_new_name_wins_when_both_present():
    m = parse_vllm_metrics(NEW + OLD.replace("vllm:num_requests", "vllm:x_num_requests"))
    assert m["kv_cache_usage"] == pytest.approx(0.375)
    assert m["itl_seconds_count"] == 40.0
    assert m["prefix_cache_queries"] == 1000.0


def test_name_table_lists_old_and_new():
    assert VLLM_METRIC_NAMES["kv_cache_usage"] == ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert VLLM_METRIC_NAMES["itl_seconds"][1] == "vllm:time_per_output_token_seconds"


def test_parse_garbage_raises():
    """A malformed line of one of our metrics raises; a page without them (an error page) reads
    as nothing exposed (batchpilot.prom skips the lines of metrics nobody asked for)."""
    with pytest.raises(ValueError, match="Prometheus.*num_requests_running"):
        parse_vllm_metrics('vllm:num_requests_running{engine="0" 3\n')
    assert parse_vllm_metrics("this is { not metrics\n") == {}
