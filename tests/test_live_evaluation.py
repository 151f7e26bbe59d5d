"""Live evaluation (issue 16): trace windows as vLLM's ``timed_trace`` JSONL (clipped for the tiny
model, timestamps monotone, bad input named by file and line, read back by vLLM's own dataset
class), the interleaving and the results files; and one short live run (two rounds, a small
window, vllm_direct and pid) whose output shape and accounting are checked, not its numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.envs.timed_trace import (
    HASH_STRIDE,
    TimedTraceOptions,
    convert_trace,
    read_timed_trace,
    write_timed_trace,
)
from batchpilot.envs.traces import TraceFormatError, TraceOptions
from batchpilot.evaluation.live import _check, schedule
from batchpilot.evaluation.live_client import row_from_result
from batchpilot.evaluation.live_errors import LiveEvaluationError
from batchpilot.evaluation.live_metrics import ENGINE_COUNTERS, GATEWAY_COUNTERS, engine_row_fields, prom_values
from batchpilot.evaluation.live_results import LIVE_ROW_KEYS, paired_differences, write_results

AZURE = REPO_ROOT / "data/traces/azure_llm_2023_conv.csv"
MOONCAKE = REPO_ROOT / "data/traces/mooncake_synthetic.jsonl"


def _opts(**kw) -> TimedTraceOptions:
    trace = TraceOptions(duration_s=kw.pop("duration_s", 120.0), max_model_len=kw.pop("max_model_len", 2048),
                         time_scale=kw.pop("time_scale", 1.0))
    return TimedTraceOptions(trace=trace, **{"max_prompt_len": 1800, "max_output_len": 128, **kw})


# --- trace -> timed_trace JSONL ---------------------------------------------------------------
@pytest.mark.parametrize("path,fmt", [(AZURE, "azure"), (MOONCAKE, "mooncake")])
def test_conversion_clips_lengths_and_keeps_time_order(path: Path, fmt: str) -> None:
    tf = convert_trace(path, fmt, _opts())
    assert len(tf) > 50
    ts = [r["timestamp"] for r in tf.records]
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:]))
    assert ts[-1] < 120.0
    for r in tf.records:
        assert 1 <= r["input_length"] <= 1800 and 1 <= r["output_length"] <= 128
        assert r["input_length"] + r["output_length"] <= 2048
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / tf.chunk_tokens)
    assert tf.clipped > 0 and "clipped" in tf.summary


def test_prompt_is_cut_before_the_output() -> None:
    """A 40k-token Mooncake prompt with 6 output tokens keeps its 6 outputs (the prompt is cut
    to max_prompt_len), not 2047 + 1 as the model-length clip alone would make it."""
    tf = convert_trace(MOONCAKE, "mooncake", _opts(duration_s=1.0))
    first = tf.records[0]
    assert (first["input_length"], first["output_length"]) == (1800, 6)
    tf2 = convert_trace(MOONCAKE, "mooncake", _opts(duration_s=1.0, max_prompt_len=4000, max_model_len=2048))
    assert tf2.records[0]["input_length"] + tf2.records[0]["output_length"] == 2048


def test_time_scale_and_max_requests() -> None:
    slow = convert_trace(AZURE, "azure", _opts(duration_s=60.0))
    fast = convert_trace(AZURE, "azure", _opts(duration_s=60.0, time_scale=2.0))
    assert len(fast) == len(slow)
    assert fast.records[-1]["timestamp"] == pytest.approx(slow.records[-1]["timestamp"] / 2, abs=1e-5)
    cut = convert_trace(AZURE, "azure", _opts(max_requests=7))
    assert len(cut) == 7 and cut.records == slow.records[:7]


def test_time_stretch_sets_the_rate_and_keeps_the_requests() -> None:
    tf = convert_trace(AZURE, "azure", _opts(duration_s=60.0))
    fast = tf.time_stretched(tf.rate / (3 * tf.rate))  # a load multiple of 3 on a 'capacity' of tf.rate
    assert fast.rate == pytest.approx(3 * tf.rate) and fast.duration_s == pytest.approx(tf.duration_s / 3)
    assert [(r["input_length"], r["output_length"], r["hash_ids"]) for r in fast.records] == \
        [(r["input_length"], r["output_length"], r["hash_ids"]) for r in tf.records]
    assert [r["timestamp"] for r in fast.records] == pytest.approx([r["timestamp"] / 3 for r in tf.records], abs=1e-5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time stretch"):
            tf.time_stretched(bad)


def test_prefix_sharing_is_kept_and_salts_share_nothing() -> None:
    moon = convert_trace(MOONCAKE, "mooncake", _opts(duration_s=300.0))
    firsts = [r["hash_ids"][0] for r in moon.records]
    assert len(set(firsts)) < len(firsts), "Mooncake's shared prefixes should survive the conversion"
    azure = convert_trace(AZURE, "azure", _opts())
    ids = [h for r in azure.records for h in r["hash_ids"]]
    assert len(ids) == len(set(ids)), "a trace without prefix ids gets fresh, unshared blocks"
    a, b = azure.salted(1), azure.salted(2)
    ia, ib = {h for r in a for h in r["hash_ids"]}, {h for r in b for h in r["hash_ids"]}
    assert not ia & ib and min(ib) >= 2 * HASH_STRIDE
    assert [r["timestamp"] for r in a] == [r["timestamp"] for r in azure.records]


def test_write_read_round_trip(tmp_path: Path) -> None:
    tf = convert_trace(AZURE, "azure", _opts(max_requests=30))
    p = write_timed_trace(tf.salted(3), tmp_path / "w.jsonl")
    back = read_timed_trace(p, tf.chunk_tokens)
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in back] == [
        (r["timestamp"], r["input_length"], r["output_length"]) for r in tf.records]
    assert tf.client_args()[:2] == ["--dataset-name", "timed_trace"]


@pytest.mark.parametrize("text,needle", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.0,abc,5\n",
     ":3: ContextTokens is not a number"),
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,374\n", ":1: missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", ":2: TIMESTAMP is not a date-time"),
])
def test_bad_trace_names_file_and_line(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceFormatError) as e:
        convert_trace(p, "azure", _opts())
    assert str(p) in str(e.value) and needle in str(e.value)


def test_bad_mooncake_line_is_named(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 5, "input_len')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: invalid JSON"):
        convert_trace(p, "mooncake", _opts())


@pytest.mark.parametrize("lines,needle", [
    (['{"timestamp": 1.0, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
      '{"timestamp": 0.5, "input_length": 10, "output_length": 2, "hash_ids": [2]}'], ":2: timestamp 0.5 is before"),
    (['{"timestamp": 0, "input_length": 10, "output_length": 2}'], ":1: missing field(s) ['hash_ids']"),
    (['{"timestamp": 0, "input_length": 1000, "output_length": 2, "hash_ids": [1]}'], ":1: 1 hash_ids cover fewer"),
    (['{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": []}'], ":1: input_length must be"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}', ""], ":2: blank line"),
])
def test_bad_timed_trace_names_file_and_line(tmp_path: Path, lines: list[str], needle: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as e:
        read_timed_trace(p, 512)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_empty_window_is_an_error() -> None:
    with pytest.raises(ValueError, match="no request"):
        convert_trace(AZURE, "azure", TimedTraceOptions(trace=TraceOptions(start_s=10**7, duration_s=1.0)))


@pytest.mark.slow
def test_vllm_timed_trace_dataset_reads_the_file(tmp_path: Path, tiny_model_path: Path) -> None:
    """vLLM's own ``TimedTrace`` dataset (what ``--dataset-name timed_trace`` loads) builds
    prompts of exactly the converted lengths, at the converted timestamps."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import TimedTrace

    tf = convert_trace(MOONCAKE, "mooncake", _opts(max_requests=12))
    p = write_timed_trace(tf.salted(1), tmp_path / "m.jsonl")
    ds = TimedTrace(dataset_path=str(p), random_seed=0, timed_trace_chunk_hash_size=tf.chunk_tokens,
                    timed_trace_sec_multiplier=1.0, timed_trace_label_timestamp="timestamp",
                    timed_trace_label_input_length="input_length", timed_trace_label_output_length="output_length",
                    timed_trace_label_hash_ids="hash_ids")
    samples = ds.sample(tokenizer=AutoTokenizer.from_pretrained(tiny_model_path), num_requests=len(tf))
    assert [s.prompt_len for s in samples] == [r["input_length"] for r in tf.records]
    assert [s.expected_output_len for s in samples] == [r["output_length"] for r in tf.records]
    assert [s.timestamp for s in samples] == [r["timestamp"] for r in tf.records]


# --- interleaving and results ------------------------------------------------------------------
def test_rotation_puts_every_path_in_every_position() -> None:
    paths = ["vllm_direct", "static", "pid", "ppo"]
    order = schedule(paths, 4)
    assert all(sorted(r) == sorted(paths) for r in order)
    for pos in range(4):
        assert sorted(r[pos] for r in order) == sorted(paths)
    assert schedule(paths, 2, "fixed") == [paths, paths]
    sh = schedule(paths, 3, "shuffle", seed=1)
    assert sh == schedule(paths, 3, "shuffle", seed=1) and all(sorted(r) == sorted(paths) for r in sh)
    with pytest.raises(LiveEvaluationError):
        schedule(paths, 2, "zigzag")


def test_config_checks() -> None:
    cfg = load_config(["rounds=2", "paths=[vllm_direct,pid]", "out_dir=/tmp/x"], config_name="live_evaluate")
    assert _check(cfg) == ["vllm_direct", "pid"]
    assert cfg.live_scenario.name == "steady"
    kv = load_config(["live_scenario=kv_tight", "out_dir=/tmp/x"], config_name="live_evaluate")
    assert "--num-gpu-blocks-override" in list(kv.live_scenario.vllm_args)
    for bad, needle in ((["paths=[vllm_direct,aimd]"], "paths"), (["paths=[pid,pid]"], "paths"),
                        (["rounds=0"], "rounds"), (["twin_ingress_latency_s=-0.01"], "twin_ingress_latency_s"),
                        (["twin_hardware=no_such_cpu"], "twin_hardware"),
                        (["slo.ttft_ms=nan"], r"slo.ttft_ms must be a positive number"),
                        (["slo.tpot_ms=0"], r"slo.tpot_ms must be a positive number")):
        with pytest.raises(LiveEvaluationError, match=needle):
            _check(load_config([*bad, "out_dir=/tmp/x"], config_name="live_evaluate"))


def test_a_bad_scenario_window_fails_before_anything_is_written_or_started(tmp_path: Path) -> None:
    from batchpilot.evaluation.live import live_evaluate

    out = tmp_path / "never"
    for bad, needle in ((["live_scenario.duration_s=-5"], r"live_scenario 'steady': duration_s must be > 0"),
                        (["live_scenario.trace=/no/such/trace.csv"], r"live_scenario 'steady': .*not found"),
                        (["live_scenario.format=bogus"], r"live_scenario 'steady': .*format")):
        with pytest.raises(LiveEvaluationError, match=needle):
            live_evaluate(load_config([*bad, f"out_dir={out}"], config_name="live_evaluate"))
    assert not out.exists()


def test_a_given_capacity_replays_another_runs_load_without_a_probe() -> None:
    """Two runs of a sized scenario compare one setting only if they replay the same load: a
    run's ``load.capacity_req_s`` given back sizes the window exactly as its probe did, and no
    probe runs; the probed path sizes on what the probe measured."""
    from batchpilot.evaluation.live_probes import machine_load
    from batchpilot.evaluation.live_window import scenario_trace

    cfg = load_config(["live_scenario=code", "out_dir=/tmp/x"], config_name="live_evaluate")
    sc = cfg.live_scenario
    tf = scenario_trace(sc)
    probes: list[int] = []

    def probe(records):
        probes.append(len(records))
        assert all(r["timestamp"] == 0.0 for r in records)  # all sent at once
        return {"request_throughput": 7.5, "completed": len(records)}

    probed, sized, replayed = machine_load(sc, tf, probe)
    assert probes == [len(tf)] and probed["capacity_req_s"] == 7.5
    assert replayed.rate == pytest.approx(7.5 * float(sc.load_multiple), rel=1e-3)
    sc.capacity_req_s = probed["capacity_req_s"]
    given, sized_again, again = machine_load(sc, tf, probe)
    assert probes == [len(tf)] and given["capacity_given"]  # not probed again
    assert sized_again == {**sized, "capacity_req_s": 7.5}
    assert [(r["timestamp"], r["input_length"]) for r in again.records] == \
        [(r["timestamp"], r["input_length"]) for r in replayed.records]
    for bad, needle in ((["live_scenario.capacity_req_s=-1"], "capacity_req_s=-1.0 must be a positive"),
                        (["live_scenario=kv_tight", "live_scenario.capacity_req_s=5"], "set that too")):
        with pytest.raises(LiveEvaluationError, match=needle):
            _check(load_config([*bad, "out_dir=/tmp/x"], config_name="live_evaluate"))


def test_prom_values_sums_label_sets() -> None:
    text = ('# HELP x\nvllm:num_preemptions_total{engine="0"} 3.0\nvllm:num_preemptions_total{engine="1"} 2.0\n'
            'vllm:kv_cache_usage_perc 0.25\nother 9\n')
    m = prom_values(text, ["vllm:num_preemptions_total", "vllm:kv_cache_usage_perc", "missing"])
    assert m == {"vllm:num_preemptions_total": 5.0, "vllm:kv_cache_usage_perc": 0.25, "missing": 0.0}


def test_engine_fields_are_the_counters_deltas_over_a_run() -> None:
    before = dict.fromkeys(ENGINE_COUNTERS, 0.0) | {"vllm:num_preemptions_total": 4.0,
                                                    "vllm:iteration_tokens_total_count": 100.0,
                                                    "vllm:iteration_tokens_total_sum": 5000.0}
    after = before | {"vllm:num_preemptions_total": 6.0, "vllm:iteration_tokens_total_count": 300.0,
                      "vllm:iteration_tokens_total_sum": 85000.0, "vllm:request_queue_time_seconds_count": 40.0,
                      "vllm:request_queue_time_seconds_sum": 2.0}
    f = engine_row_fields(before, after)
    assert {k: f[k] for k in ("preemptions", "engine_iterations", "mean_iteration_tokens", "mean_engine_queue_ms")} == {
        "preemptions": 2.0, "engine_iterations": 200.0, "mean_iteration_tokens": 400.0, "mean_engine_queue_ms": 50.0}
    assert math.isnan(f["mean_engine_ttft_ms"])  # no first token counted
    assert math.isnan(f["mean_admission_wait_ms"])  # no gateway counters: vLLM direct
    idle = engine_row_fields(before, before)  # nothing ran: no mean to take
    assert idle["engine_iterations"] == 0 and math.isnan(idle["mean_iteration_tokens"])
    assert math.isnan(idle["mean_engine_queue_ms"])
    gw0 = dict.fromkeys(GATEWAY_COUNTERS, 0.0)
    gw1 = {"batchpilot:admission_wait_seconds_count": 4.0, "batchpilot:admission_wait_seconds_sum": 1.0}
    assert engine_row_fields(before | gw0, after | gw1)["mean_admission_wait_ms"] == 250.0
    restarted = after | {"vllm:num_preemptions_total": 1.0}  # vLLM restarted during the run: from the reset
    assert engine_row_fields(before, restarted)["preemptions"] == 1.0


def _fake_rows() -> list[dict]:
    rows = []
    for rnd, (base, pid) in enumerate([(2.0, 2.5), (3.0, 3.4), (2.5, 3.1)]):
        for pos, (path, g) in enumerate([("vllm_direct", base), ("pid", pid)]):
            res = {"completed": 9, "failed": 1, "duration": 10.0, "request_goodput": g, "request_throughput": 0.9,
                   "errors": ["", "Traceback\nServerDisconnectedError: boom"] + [""] * 8}
            row = row_from_result(res, scenario="steady", path=path, rnd=rnd, position=pos, requests=10)
            row.update(preemptions=0.0, peak_kv_usage=0.1, peak_running=3, acting=path, kv_dtype="auto",
                       engine_restarts=0, wall_s=12.0)
            rows.append(row)
    return rows


def test_rows_account_for_every_request_and_files_are_written(tmp_path: Path) -> None:
    rows = _fake_rows()
    r0 = rows[0]
    assert r0["accounted"] and r0["completed"] + r0["failed"] == r0["requests"]
    assert r0["slo_attainment"] == pytest.approx(2.0)  # 20 good of 10: fake numbers, the formula only
    assert r0["first_error"] == "ServerDisconnectedError: boom"
    bad = row_from_result({"completed": 8, "failed": 1}, scenario="s", path="pid", rnd=0, position=0, requests=10)
    assert not bad["accounted"]
    d = paired_differences(rows)
    assert len(d) == 1 and d[0]["path"] == "pid" and d[0]["n"] == 3
    assert d[0]["mean_diff"] == pytest.approx((0.5 + 0.4 + 0.6) / 3)
    assert d[0]["significant"]  # diffs 0.4-0.6: the paired CI excludes 0 even if the levels overlap
    files = write_results(rows, tmp_path, meta={"trace": "x", "requests_per_run": 10, "window_s": 5.0})
    for key in ("json", "csv", "md", "plot"):
        assert files[key].is_file() and files[key].stat().st_size > 0
    data = json.loads(files["json"].read_text())
    assert len(data["rows"]) == 6 and list(data["rows"][0]) == list(LIVE_ROW_KEYS)
    md = files["md"].read_text()
    assert "| steady | pid | 3 |" in md and "yes" in md


# --- one short live evaluation -------------------------------------------------------------------
@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_live_evaluation(tmp_path: Path, tiny_model_path: Path) -> None:
    from batchpilot.evaluation.live import live_evaluate

    # Sized to this machine (load_multiple) and short: `steady`'s first 15 trace seconds (24
    # requests) at 5x, a 3 s window, replayed for as long as written at 2x what vLLM serves here
    # (max_requests is refused on a sized scenario: a fixed count at the sized rate lasted under a
    # second). The gateway ticks every 0.25 s (1 s by default) so that its decisions file holds
    # some ticks whatever the machine's speed.
    cfg = load_config(["rounds=2", "paths=[vllm_direct,pid]", "live_scenario.duration_s=15",
                       "live_scenario.time_scale=5",
                       "live_scenario.load_multiple=2.0", "warmup.requests=6", f"out_dir={tmp_path}",
                       'gateway.overrides=["control.interval_s=0.25"]'],
                      config_name="live_evaluate")
    out = live_evaluate(cfg, model_dir=tiny_model_path)
    rows = out["rows"]
    data = json.loads((tmp_path / "results.json").read_text())
    n = data["meta"]["requests_per_run"]
    assert [(r["round"], r["path"]) for r in rows] == [(0, "vllm_direct"), (0, "pid"), (1, "pid"), (1, "vllm_direct")]
    for r in rows:
        assert r["requests"] == n and r["accounted"], r
        assert r["completed"] + r["failed"] == n
        assert r["completed"] > 0 and math.isfinite(r["request_goodput"])
        assert r["acting"] == ("vllm" if r["path"] == "vllm_direct" else "pid")
        assert r["engine_iterations"] > 0 and r["mean_iteration_tokens"] > 0 and r["mean_engine_queue_ms"] >= 0
        assert r["mean_engine_ttft_ms"] > 0
        assert math.isnan(r["mean_admission_wait_ms"]) if r["path"] == "vllm_direct" else r["mean_admission_wait_ms"] >= 0
        # labelled with the trace and the window replayed, not only the scenario's name
        assert r["scenario"].startswith("steady (azure_llm_2023_conv.csv, trace s 0-"), r["scenario"]
    for name in ("results.json", "results.csv", "results.md", "goodput.png", "gateway.log", "live_evaluate.log",
                 ".hydra/config.yaml"):
        assert (tmp_path / name).is_file(), name
    # vLLM's log is kept beside gateway.log (serve.log_dir), not in a /tmp folder left behind
    assert list(tmp_path.glob("vllm-*.log")) and not (tmp_path / "gateway_hydra").exists()
    assert len(data["rows"]) == 4
    # Sized to this machine: a saturated probe of the written window's requests, then 2x its throughput.
    load = data["meta"]["load"]
    assert load["capacity_req_s"] > 0 and load["load_multiple"] == 2.0 and load["requests"] == n
    assert load["replayed_rate_req_s"] == pytest.approx(2.0 * load["capacity_req_s"], rel=1e-3)
    assert data["meta"]["window_s"] == pytest.approx(n / load["replayed_rate_req_s"], rel=1e-3)
    # Not the sub-second window a fixed count gave: seconds the control loop can act in. How far
    # past the written 3 s (15 trace s at 5x) depends on where this machine's sized window's few
    # requests fall (the last exact stretch): 3.7 s and 7.0 s on two runs of the same CPU.
    assert data["meta"]["window_s"] >= 1.5
    assert (tmp_path / "runs" / "capacity_probe.jsonl").is_file()
    assert [d["path"] for d in data["paired_differences"]] == ["pid"]
    # The twin, its speed matched to the live vllm_direct runs (the two of them, nothing else).
    twin = json.loads((tmp_path / "twin.json").read_text())
    assert [r["path"] for r in twin["rows"]] == ["vllm_direct", "pid"]
    assert twin["match"]["live_runs"] == 2 and twin["match"]["slowdown"] > 0
    assert "Speed matched to the live reference" in (tmp_path / "results.md").read_text() or twin["match"]["reason"]
    runs = sorted(p.name for p in (tmp_path / "runs").glob("r*.jsonl") if ".decisions" not in p.name)
    assert runs == ["r0_pid.jsonl", "r0_vllm_direct.jsonl", "r1_pid.jsonl", "r1_vllm_direct.jsonl"]
    # The gateway's decisions during each gateway run, a line per control tick (how many depends
    # on the machine; every run spans several at 0.25 s).
    decisions = [json.loads(line) for rnd in (0, 1)
                 for line in (tmp_path / "runs" / f"r{rnd}_pid.decisions.jsonl").read_text().splitlines()]
    assert decisions and all(d["acting"] == "pid" and d["batch_cap"] >= 1 for d in decisions)
    assert not list((tmp_path / "runs").glob("*vllm_direct.decisions.jsonl"))
    assert all(r["mean_batch_cap"] is None for r in data["rows"] if r["path"] == "vllm_direct")
    # Every run replayed its own prompts: no hash id in two runs (no prefix-cache carry-over).
    seen: set[int] = set()
    for name in runs:
        ids = {h for r in read_timed_trace(tmp_path / "runs" / name, 512) for h in r["hash_ids"]}
        assert not ids & seen
        seen |= ids
