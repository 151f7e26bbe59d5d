"""The simulated twin of a live evaluation (issue 16): the same converted requests on the
calibrated simulator, one row per path with every request accounted for, the share of the
simulated gain that survives live (and "no simulated gain" instead of dividing by ~0), and the
twin of a finished live run's folder. No vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from batchpilot.config import REPO_ROOT
from batchpilot.evaluation.live_twin import (
    SECTION,
    header_priority,
    match_slowdown,
    ranking,
    ranking_markdown,
    run_twin,
    stream_from_records,
    survival,
    twin_gateway_overrides,
    twin_markdown,
    twin_of,
    twin_of_rows,
    twin_overrides,
    twin_summary,
)
from batchpilot.evaluation.live_window import scenario_trace, sized_window

SLO = {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def _scenario(name: str = "kv_tight", n: int = 16) -> dict:
    sc = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "live_scenario" / f"{name}.yaml"))
    assert isinstance(sc, dict)
    sc["max_requests"] = n
    return sc


def test_stream_is_the_converted_requests() -> None:
    tf = scenario_trace(OmegaConf.create(_scenario(n=10)))
    s = stream_from_records(tf.records, tf.chunk_tokens, priority=1, duration_s=tf.duration_s)
    assert len(s) == 10
    assert list(s.arrival_s) == [r["timestamp"] for r in tf.records]
    assert list(s.prompt_len) == [r["input_length"] for r in tf.records]
    assert list(s.output_len) == [r["output_length"] for r in tf.records]
    assert set(s.priority.tolist()) == {1} and s.prefix_block_tokens == tf.chunk_tokens
    assert [list(h) for h in s.prefix_hashes] == [r["hash_ids"] for r in tf.records]
    assert header_priority(["x-priority=0", "x-batchpilot-key=k"], 1) == 0
    assert header_priority([], 1) == 1


def test_overrides_carry_the_kv_budget_and_scheduler() -> None:
    ov = twin_overrides(_scenario(), SLO, ["--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "96"])
    for o in ("engine=sim", "model=tiny_llama", "hardware=cpu_tiny_served", "engine.block_size=32",
              "engine.num_gpu_blocks_override=96", "engine.max_num_batched_tokens=2048", "slo.ttft_ms=1000.0",
              "env.drain_controlled=true"):
        assert o in ov
    assert not any("num_gpu_blocks_override" in o for o in twin_overrides(_scenario("steady"), SLO, []))



def test_the_twin_charges_the_served_round_trip() -> None:
    """The live client's TTFT includes the request's trip through the API server; the twin's
    engine sees each request that much later (``engine.ingress_latency_s``)."""
    assert "engine.ingress_latency_s=0.0" in twin_overrides(_scenario(), SLO, [])
    assert "engine.ingress_latency_s=0.05" in twin_overrides(_scenario(), SLO, [], ingress_latency_s=0.05)
    assert "hardware=cpu_tiny_served" in twin_overrides(_scenario(), SLO, [])  # the committed served profile
    assert "hardware=cpu_tiny_epyc_served" in twin_overrides(_scenario(), SLO, [], hardware="cpu_tiny_epyc_served")
    sc = _scenario("steady", n=12)
    tf = scenario_trace(OmegaConf.create(sc))
    at_once, late = (run_twin(tf, sc, SLO, paths=["vllm_direct"], ingress_latency_s=lat, log=lambda m: None)[0]
                     for lat in (0.0, 0.05))
    assert late["completed"] == at_once["completed"] == 12
    assert 40 < late["mean_ttft_ms"] - at_once["mean_ttft_ms"] < 75

def test_the_twin_runs_under_the_gateways_shield_and_admission_overrides() -> None:
    """A live run whose gateway was started with shield, control-loop or admission overrides is
    predicted under the same ones (one shield, one control group); the gateway's other settings
    have no twin key."""
    gw = ["shield.max_batch=4", "serve.admission.on_time_first=false", "serve.port=9000", "control.interval_s=0.5",
          "serve.control.stale_limit=5"]
    assert twin_gateway_overrides(gw) == ["shield.max_batch=4", "env.admission.on_time_first=false",
                                          "control.interval_s=0.5"]
    assert twin_gateway_overrides(["~shield.breaker_shrink", "+serve.admission.x=1"]) == [
        "~shield.breaker_shrink", "+env.admission.x=1"]  # Hydra's delete / add prefixes kept
    ov = twin_overrides(_scenario(), SLO, [], twin_gateway_overrides(["shield.breaker_shrink=0.5"]))
    assert [o for o in ov if o.startswith("shield.breaker_shrink=")] == ["shield.breaker_shrink=0.5"]
    sc = _scenario("steady", n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    live = [{"path": "pid", "round": 0, "request_goodput": 1.0}]
    rows, _ = twin_of_rows(tf, sc, SLO, live, paths=["pid"], match=False, gateway_overrides=gw, log=lambda m: None)
    free, _ = twin_of_rows(tf, sc, SLO, live, paths=["pid"], match=False, log=lambda m: None)
    # the shield steps the start-up cap down by at most 30 % a tick, to its max_batch of 4
    capped, own = rows[0]["timeline"]["batch_cap"], free[0]["timeline"]["batch_cap"]
    assert capped[-1] <= 4 < min(own) and capped[1] < capped[0]


@pytest.mark.slow
def test_twin_of_a_small_scenario_accounts_for_every_request() -> None:
    sc = _scenario(n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    paths = ["vllm_direct", "static", "pid", "ppo"]
    rows = run_twin(tf, sc, SLO, paths=paths, vllm_args=sc["vllm_args"], log=lambda m: None)
    assert [r["path"] for r in rows] == paths
    assert rows[0]["controller"] == "vllm_default (as shipped)"
    for r in rows:
        assert r["requests"] == 16 and r["accounted"] and r["completed"] + r["rejected"] == 16
        assert r["error"] == "" and math.isfinite(r["request_goodput"]) and r["request_goodput"] >= 0
        assert 0 < r["peak_kv_usage"] <= 1.0
        assert r["engine_iterations"] > 0 and 0 < r["mean_iteration_tokens"] <= 2048  # within the token budget
    # deterministic: the same twin twice gives the same numbers
    again = run_twin(tf, sc, SLO, paths=["vllm_direct"], vllm_args=sc["vllm_args"], log=lambda m: None)
    assert again[0]["request_goodput"] == rows[0]["request_goodput"]
    with pytest.raises(ValueError, match="paths must be among"):
        run_twin(tf, sc, SLO, paths=["best_static"], log=lambda m: None)


def test_the_speed_match_recovers_a_known_slowdown() -> None:
    """Live vllm_direct rows made by the twin itself at slowdown 3: the match finds a slowdown
    that reproduces their TPOT (within 2 %) near 3, reading only vllm_direct's rows."""
    sc = _scenario(n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    ref = run_twin(tf, sc, SLO, paths=["vllm_direct"], vllm_args=sc["vllm_args"], slowdown=3.0, log=lambda m: None)[0]
    live = [{"path": "vllm_direct", "round": r, "mean_tpot_ms": ref["mean_tpot_ms"]} for r in range(3)]
    live += [{"path": "pid", "round": r, "mean_tpot_ms": 1e6} for r in range(3)]  # never read
    m = match_slowdown(tf, sc, SLO, live, vllm_args=sc["vllm_args"], log=lambda msg: None)
    assert m["matched"] and m["live_runs"] == 3 and m["target_ms"] == pytest.approx(ref["mean_tpot_ms"])
    assert m["sim_ms"] == pytest.approx(ref["mean_tpot_ms"], rel=0.02)
    assert m["slowdown"] == pytest.approx(3.0, rel=0.15) and m["profile_ms"] < m["target_ms"]
    none = match_slowdown(tf, sc, SLO, live[3:], log=lambda msg: None)
    assert none["slowdown"] == 1.0 and not none["matched"] and "no live vllm_direct run" in none["reason"]
    far = match_slowdown(tf, sc, SLO, [{"path": "vllm_direct", "mean_tpot_ms": 1e-6}], log=lambda msg: None)
    assert not far["matched"] and far["slowdown"] == 0.25 and "outside" in far["reason"]


def test_the_gateway_paths_factor_is_matched_on_static_alone() -> None:
    """Live rows made by the twin at slowdown 3 (vllm_direct) and 3 x 1.6 (static, behind the
    gateway): the match finds both factors, reading only those two paths' rows; the rows it
    then gives run every gateway path at slowdown x factor."""
    sc = _scenario(n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    direct = run_twin(tf, sc, SLO, paths=["vllm_direct"], vllm_args=sc["vllm_args"], slowdown=3.0,
                      log=lambda m: None)[0]
    static, pid = run_twin(tf, sc, SLO, paths=["static", "pid"], vllm_args=sc["vllm_args"], slowdown=4.8,
                           log=lambda m: None)
    live = [{"path": p, "round": r, "mean_tpot_ms": x["mean_tpot_ms"]} for r in range(2)
            for p, x in (("vllm_direct", direct), ("static", static))]
    live += [{"path": "pid", "round": r, "mean_tpot_ms": 1e6} for r in range(2)]  # never read
    m = match_slowdown(tf, sc, SLO, live, vllm_args=sc["vllm_args"], gateway=True, log=lambda msg: None)
    gw = m["gateway"]
    assert m["matched"] and gw["matched"] and gw["live_runs"] == 2
    assert gw["sim_ms"] == pytest.approx(static["mean_tpot_ms"], rel=0.02)
    assert m["slowdown"] * m["gateway_factor"] == pytest.approx(4.8, rel=0.15)
    rows, m2 = twin_of_rows(tf, sc, SLO, live, paths=["vllm_direct", "pid"], vllm_args=sc["vllm_args"],
                            log=lambda msg: None)
    assert m2["gateway_factor"] == m["gateway_factor"]
    assert rows[1]["mean_tpot_ms"] == pytest.approx(pid["mean_tpot_ms"], rel=0.1)
    alone = match_slowdown(tf, sc, SLO, live[:1], vllm_args=sc["vllm_args"], gateway=True, log=lambda msg: None)
    assert alone["gateway_factor"] == 1.0 and "no live static run" in alone["gateway"]["reason"]
    assert "The paths through the gateway run at" in twin_markdown(rows, twin_summary(rows, live), match=m)


def test_survival_share() -> None:
    s = survival(0.5, 2.0, 0.4, 0.1)
    assert s["share"] == pytest.approx(0.8) and s["target_met"] is True
    assert s["share_lo"] == pytest.approx(0.6) and s["share_hi"] == pytest.approx(1.0)
    assert "80% survives" in s["verdict"] and "met" in s["verdict"]
    s = survival(0.5, 2.0, 0.1, 0.3)
    assert s["share"] == pytest.approx(0.2) and s["target_met"] is False
    assert "not met" in s["verdict"] and "includes 0" in s["verdict"]
    # ~0 simulated gain (2 % of the reference's goodput): nothing to divide by
    for sim_gain in (0.0, 0.03, -0.03, 1e-12):
        s = survival(sim_gain, 2.0, 0.4, 0.1)
        assert s["share"] is None and s["target_met"] is None
        assert s["verdict"].startswith("no simulated gain to survive")
    s = survival(-0.5, 2.0, 0.4, 0.1)
    assert s["share"] is None and "predicts a loss" in s["verdict"]
    assert survival(math.nan, 2.0, 0.4, 0.1)["verdict"] == "no simulated result"


def test_the_twin_runs_vllm_tuned_at_the_flags_the_live_run_chose() -> None:
    """vllm_tuned in the twin is vLLM alone with the live run's chosen flags: a tight
    queued-tokens limit refuses at arrival (vLLM's API server's 503), no limit refuses nothing;
    without the flags the path is refused, naming them."""
    sc = _scenario(n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    quiet = lambda m: None  # noqa: E731
    tight, loose = (run_twin(tf, sc, SLO, paths=["vllm_tuned"], vllm_args=sc["vllm_args"], log=quiet,
                             tuned_flags=flags)[0]
                    for flags in ({"max_num_seqs": 1, "max_num_queued_tokens": 1}, {"max_num_seqs": 64}))
    for r in (tight, loose):
        assert r["controller"] == "vllm_tuned (as shipped)" and r["accounted"] and r["error"] == ""
    assert tight["rejected"] > 0 and loose["rejected"] == 0
    with pytest.raises(ValueError, match="vllm_tuned: the twin runs the live run's chosen flags"):
        run_twin(tf, sc, SLO, paths=["vllm_tuned"], log=quiet)


def test_a_run_with_vllm_tuned_matches_the_speed_there() -> None:
    """With vllm_tuned runs (vLLM straight, at the concurrency the gateway paths run) the twin's
    speed is fitted on them, not on vllm_direct's (whose live TPOT is never read then)."""
    sc = _scenario(n=16)
    tf = scenario_trace(OmegaConf.create(sc))
    flags = {"max_num_seqs": 8}
    tuned = run_twin(tf, sc, SLO, paths=["vllm_tuned"], vllm_args=sc["vllm_args"], slowdown=3.0, tuned_flags=flags,
                     log=lambda m: None)[0]
    live = [{"path": "vllm_tuned", "round": r, "mean_tpot_ms": tuned["mean_tpot_ms"]} for r in range(3)]
    live += [{"path": "vllm_direct", "round": r, "mean_tpot_ms": 1e6} for r in range(3)]  # never read
    rows, m = twin_of_rows(tf, sc, SLO, live, paths=["vllm_direct", "vllm_tuned"], vllm_args=sc["vllm_args"],
                           match_gateway=False, tuned_flags=flags, log=lambda msg: None)
    assert m is not None and m["matched"] and m["path"] == "vllm_tuned" and m["live_runs"] == 3
    assert m["slowdown"] == pytest.approx(3.0, rel=0.15)
    assert rows[1]["mean_tpot_ms"] == pytest.approx(tuned["mean_tpot_ms"], rel=0.02)
    _, m_direct = twin_of_rows(tf, sc, SLO, live, paths=["vllm_direct"], vllm_args=sc["vllm_args"],
                               match_gateway=False, log=lambda msg: None)  # no flags: vllm_direct's, as before
    assert m_direct is not None and m_direct["path"] == "vllm_direct"


def test_ranking_names_the_pairs_that_flip_and_whether_live_is_clear_of_the_noise() -> None:
    sim = [{"path": "vllm_tuned", "request_goodput_run": 1.0}, {"path": "pid", "request_goodput_run": 2.0},
           {"path": "ppo", "request_goodput_run": 2.1}, {"path": "vllm_direct", "request_goodput_run": 0.1}]
    live = [{"path": p, "round": r, "request_goodput": g}
            for r, gs in enumerate([(5.0, 4.0, 3.0), (5.5, 4.2, 6.0), (5.2, 4.1, 3.5)])
            for p, g in zip(("vllm_tuned", "pid", "ppo"), gs)]
    rank = ranking(sim, live)
    assert rank["sim"] == ["ppo", "pid", "vllm_tuned"] and rank["live"] == ["vllm_tuned", "ppo", "pid"]
    assert not rank["same"]
    flips = {(f["ahead_in_sim"], f["ahead_live"]): f for f in rank["flips"]}
    assert set(flips) == {("ppo", "vllm_tuned"), ("pid", "vllm_tuned")}  # ppo > pid holds in both
    assert flips[("pid", "vllm_tuned")]["clear"]  # +1.0, +1.3, +1.1 every round
    assert not flips[("ppo", "vllm_tuned")]["clear"]  # +2.0, -0.5, +1.7: within the noise
    text = ranking_markdown(rank)
    assert "not the same order" in text and "clear of the noise" in text and "within the noise" in text
    agree = ranking(sim, [dict(r, request_goodput=-r["request_goodput"]) for r in live if r["path"] != "ppo"])
    assert agree["sim"] == agree["live"] == ["pid", "vllm_tuned"] and agree["same"] and agree["flips"] == []


def test_summary_pairs_live_rounds() -> None:
    sim = [{"path": "vllm_direct", "request_goodput": 2.0}, {"path": "pid", "request_goodput": 2.5},
           {"path": "ppo", "request_goodput": 3.0}]
    live = [{"path": p, "round": r, "request_goodput": g, "mean_tpot_ms": 5.0}
            for r, gs in enumerate([(1.0, 1.2, 1.6), (2.0, 2.0, 2.4), (1.5, 1.6, 2.0)])
            for p, g in zip(("vllm_direct", "pid", "ppo"), gs)]
    s = twin_summary(sim, live)
    g = {(x["path"], x["over"]): x for x in s["gains"]}
    assert g[("ppo", "vllm_direct")]["sim_gain"] == pytest.approx(1.0)
    assert g[("ppo", "vllm_direct")]["live_gain"] == pytest.approx(0.5)
    assert g[("ppo", "vllm_direct")]["share"] == pytest.approx(0.5)
    assert g[("ppo", "pid")]["live_gain"] == pytest.approx((0.4 + 0.4 + 0.4) / 3)
    assert g[("ppo", "pid")]["live_ci"] == pytest.approx(0.0, abs=1e-9)
    assert s["paths"]["ppo"]["live_mean"] == pytest.approx(2.0)


@pytest.mark.slow
def test_twin_of_a_finished_live_run(tmp_path: Path) -> None:
    """A live folder (results.json with meta and rows, results.md) gains twin.json and one
    "Simulated twin" section, replaced (not repeated) when computed again."""
    sc = _scenario("steady", n=8)
    tf = scenario_trace(OmegaConf.create(sc))
    rows = [{"scenario": "steady", "path": p, "round": r, "request_goodput": 1.0 + 0.1 * r, "mean_tpot_ms": 5.0}
            for r in range(2) for p in ("vllm_direct", "pid", "ppo")]
    meta = {"scenario": sc, "slo": SLO, "requests_per_run": len(tf)}
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "paired_differences": []}))
    (tmp_path / "results.md").write_text("# Live evaluation\n\nlive table\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r0_pid.decisions.jsonl").write_text(
        "".join(json.dumps({"tick": i, "t": 100.0 + i, "batch_cap": 64 - i}) + "\n" for i in range(5)))
    for _ in range(2):
        out = twin_of(tmp_path, log=lambda m: None)
    assert [r["path"] for r in out["rows"]] == ["vllm_direct", "pid", "ppo"]
    pid = out["rows"][1]
    assert pid["timeline"]["batch_cap"] and pid["mean_batch_cap"] == pytest.approx(
        sum(pid["timeline"]["batch_cap"]) / len(pid["timeline"]["batch_cap"]))
    assert (tmp_path / "cap_timeline.png").stat().st_size > 0  # the live pid run beside the twin's
    md = (tmp_path / "results.md").read_text()
    assert md.count(SECTION) == 1 and md.startswith("# Live evaluation") and "live table" in md
    assert "share that survives live" in md and "Speed matched to the live reference" in md
    assert "Where the time goes" in md and "| pid | " in md.split("Where the time goes")[1]  # a row a path
    tj = json.loads((tmp_path / "twin.json").read_text())
    assert tj["match"]["live_runs"] == 2 and tj["match"]["slowdown"] == out["match"]["slowdown"]
    assert len(tj["rows"]) == 3 and {(g["path"], g["over"]) for g in tj["gains"]} == {("ppo", "vllm_direct"),
                                                                                      ("ppo", "pid")}
    bad = dict(meta, requests_per_run=len(tf) + 1)
    (tmp_path / "results.json").write_text(json.dumps({"meta": bad, "rows": rows}))
    with pytest.raises(ValueError, match="converts to"):
        twin_of(tmp_path, log=lambda m: None)


@pytest.mark.slow
def test_a_run_without_reference_paths_takes_another_runs_twin_speed(tmp_path: Path) -> None:
    """A run of PID and PPO only (an A/B at another run's load) has no vllm_direct runs to match
    its twin's speed on: it takes the other run's match (``twin_speed_of``), says so, and runs
    its paths at exactly that speed; a folder without a matched speed is refused by name."""
    from batchpilot.evaluation.live_twin import speed_of

    sc = _scenario("steady", n=8)
    tf = scenario_trace(OmegaConf.create(sc))
    meta = {"scenario": sc, "slo": SLO, "requests_per_run": len(tf)}
    ref, ab = tmp_path / "ref", tmp_path / "ab"
    for d, paths in ((ref, ("vllm_direct", "static", "pid", "ppo")), (ab, ("pid", "ppo"))):
        d.mkdir()
        rows = [{"scenario": "steady", "path": p, "round": r, "request_goodput": 1.0, "mean_tpot_ms": 3.0 + r}
                for r in range(2) for p in paths]
        (d / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        (d / "results.md").write_text("# Live evaluation\n")
    with pytest.raises(ValueError, match="cannot read .*twin.json"):
        twin_of(ab, log=lambda m: None, speed_from=ref)
    first = twin_of(ref, log=lambda m: None)
    assert first["match"]["matched"]
    out = twin_of(ab, log=lambda m: None, speed_from=ref)
    assert out["match"]["given_from"] == str(ref) and out["match"]["slowdown"] == first["match"]["slowdown"]
    assert [r["path"] for r in out["rows"]] == ["pid", "ppo"]
    assert [r["request_goodput"] for r in out["rows"]] == [r["request_goodput"] for r in first["rows"][2:]]
    assert "Speed given from another run" in (ab / "results.md").read_text()
    assert speed_of(ab)["given_from"] == str(ref)  # passed on, still naming the run it was matched on
    (ab / "twin.json").write_text(json.dumps({"match": None, "rows": []}))
    with pytest.raises(ValueError, match="no matched speed"):
        speed_of(ab)


@pytest.mark.slow
def test_twin_of_a_run_sized_to_the_machine(tmp_path: Path) -> None:
    """A run sized by its capacity probe (``load_multiple``) replayed the window at another rate:
    the twin replays that same window, not the written one."""
    sc = {**_scenario("steady"), "max_requests": None, "duration_s": 4.0, "load_multiple": 2.0}
    written = scenario_trace(OmegaConf.create(sc))
    load = {"load_multiple": 2.0, "capacity_req_s": 3.0 * written.rate}
    _, sized = sized_window(OmegaConf.create(sc), written, 6.0 * written.rate)
    assert len(sized) > len(written)
    rows = [{"scenario": "steady", "path": p, "round": 0, "request_goodput": 1.0, "mean_tpot_ms": 5.0}
            for p in ("vllm_direct", "ppo")]
    meta = {"scenario": sc, "slo": SLO, "requests_per_run": len(sized), "load": load}
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    out = twin_of(tmp_path, log=lambda m: None)
    assert [r["requests"] for r in out["rows"]] == [len(sized)] * 2
