"""Live evaluation, the rough edges a new-user probe found: a refused run leaves nothing behind
(no Hydra folder, nothing new in an existing one), an out_dir that is a file is one line, vLLM's
logs are named in the errors (they are kept in out_dir), a failed request says the server's
message, max_requests on a sized scenario is refused, the rows name the trace window, the twin of
a run found by a cwd-relative trace, and a twin without ppo says so in one line. No vLLM: the
client's request function runs against a small aiohttp server, the twin on the real simulator."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.evaluation.live import _check
from batchpilot.evaluation.live_checks import check_out_dir
from batchpilot.evaluation.live_client import (
    error_bodies_in_client,
    error_message,
    row_from_result,
    with_error_bodies,
)
from batchpilot.evaluation.live_errors import LiveEvaluationError, wait_until
from batchpilot.evaluation.live_results import write_results
from batchpilot.evaluation.live_window import scenario_trace

SCRIPT = REPO_ROOT / "scripts" / "live_evaluate.py"
AZURE = REPO_ROOT / "data/traces/azure_llm_2023_conv.csv"


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _tree(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# --- a refused run leaves nothing behind --------------------------------------------------------
def test_a_refused_run_leaves_nothing_behind(tmp_path: Path) -> None:
    """Refused before vLLM starts: no out_dir (Hydra's .hydra/ and job log used to make it), nothing
    new in an existing one, nothing in the current folder with the default out_dir; twin_of of a
    folder without a run neither."""
    bad = 'client.headers=["x-priority"]'
    r = _script(bad, f"out_dir={tmp_path / 'new'}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "live_evaluate: error: client.headers: 'x-priority' is not KEY=VALUE"
    existing = tmp_path / "existing"
    (existing / "mine").mkdir(parents=True)
    r = _script(bad, f"out_dir={existing}", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    r = _script(bad, cwd=tmp_path)  # the default out_dir, outputs/live_evaluate/<time>, from here
    assert r.returncode == 2, r.stderr
    r = _script(f"twin_of={tmp_path / 'nothing'}", cwd=tmp_path)
    assert r.returncode == 2 and "results.json" in r.stderr and "\n" not in r.stderr.strip()
    assert _tree(tmp_path) == ["existing", "existing/mine"]


def test_an_out_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "a_file"
    f.write_text("x")
    for out in (f, f / "sub"):
        with pytest.raises(LiveEvaluationError, match=rf"^out_dir {out}: {f} is a file, not a folder; pick another"):
            check_out_dir(out)
    r = _script(f"out_dir={f}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == f"live_evaluate: error: out_dir {f}: {f} is a file, not a folder; pick another out_dir"
    assert f.read_text() == "x"


# --- vLLM's logs: in out_dir (serve.log_dir), named in the errors --------------------------------
def test_errors_name_vllms_log_beside_the_gateways(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    log.write_text("upstream vllm0 exited\n")
    (tmp_path / "vllm-8123.log").write_text("RuntimeError: no memory\n")
    with pytest.raises(LiveEvaluationError) as e:
        wait_until(lambda: False, 60, "the gateway's /readyz", alive=lambda: "the gateway exited with code 1", log=log)
    assert str(e.value) == (f"while waiting for the gateway's /readyz: the gateway exited with code 1; last lines "
                            f"of {log}: upstream vllm0 exited; vLLM's log: {tmp_path / 'vllm-8123.log'}")
    log.write_text("")  # nothing to quote: still where to look
    with pytest.raises(LiveEvaluationError, match=rf"^x: not reached after 0.1 s; see {log}; vLLM's log: "):
        wait_until(lambda: False, 0.1, "x", poll_s=0.05, log=log)


def test_the_log_folder_is_the_evaluations_to_set() -> None:
    with pytest.raises(LiveEvaluationError, match=r"sets serve.log_dir, .*kept in out_dir"):
        _check(load_config(['gateway.overrides=["serve.log_dir=/tmp/elsewhere"]', "out_dir=/tmp/x"],
                           config_name="live_evaluate"))


# --- a failed request says why --------------------------------------------------------------------
VLLM_400 = {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested "
                                 "2100 tokens (1972 in the messages, 128 in the completion).",
                      "type": "BadRequestError", "param": None, "code": 400}}


@pytest.mark.parametrize("body,msg", [
    (json.dumps(VLLM_400), VLLM_400["error"]["message"]),
    (json.dumps({"message": "priority 0 needs a trusted key"}), "priority 0 needs a trusted key"),
    (json.dumps({"detail": [{"loc": ["body", "prompt"], "msg": "field required"}]}),
     '[{"loc": ["body", "prompt"], "msg": "field required"}]'),
    ("upstream\n  timed out ", "upstream timed out"),
])
def test_error_message_reads_the_bodies_servers_send(body: str, msg: str) -> None:
    assert error_message(body) == msg


def _serve(app, port_holder: list[int]):
    from aiohttp import web

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_holder.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        return runner

    return start


def test_a_failed_request_carries_the_servers_message() -> None:
    """vLLM's own request function against a server that answers a short prompt with a stream
    and a long one with vLLM's 400: the failure says "Bad Request: This model's maximum context
    length ...", not "Bad Request" alone, and the streamed one still succeeds."""
    import aiohttp
    from aiohttp import web
    from vllm.benchmarks.lib.endpoint_request_func import (
        ASYNC_REQUEST_FUNCS,
        RequestFuncInput,
        async_request_openai_completions,
    )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if len(body["prompt"]) > 10:
            return web.json_response(VLLM_400, status=400)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for tok in ("a", "b"):
            await resp.write(f'data: {json.dumps({"choices": [{"text": tok}]})}\n\n'.encode())
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)

    async def main() -> tuple:
        ports: list[int] = []
        runner = await _serve(app, ports)()
        try:
            func = with_error_bodies(async_request_openai_completions)
            async with aiohttp.ClientSession() as session:
                outs = []
                for prompt in ("hi", "x" * 50):
                    inp = RequestFuncInput(prompt=prompt, api_url=f"http://127.0.0.1:{ports[0]}/v1/completions",
                                           prompt_len=3, output_len=2, model="m")
                    outs.append(await func(request_func_input=inp, session=session))
                plain = await async_request_openai_completions(request_func_input=inp, session=session)
            return (*outs, plain)
        finally:
            await runner.cleanup()

    ok, failed, plain = asyncio.run(main())
    assert ok.success and ok.generated_text == "ab" and ok.output_tokens == 2
    assert plain.error == "Bad Request"  # what the client says by itself
    assert not failed.success and failed.error == f"Bad Request: {VLLM_400['error']['message']}"
    row = row_from_result({"completed": 1, "failed": 1, "errors": ["", failed.error]}, scenario="s", path="pid",
                          rnd=0, position=0, requests=2)
    assert row["first_error"] == failed.error
    before = ASYNC_REQUEST_FUNCS["vllm"]
    with error_bodies_in_client("vllm"):
        assert ASYNC_REQUEST_FUNCS["vllm"] is not before and ASYNC_REQUEST_FUNCS["vllm"]._with_error_bodies
    assert ASYNC_REQUEST_FUNCS["vllm"] is before  # put back


# --- max_requests on a sized scenario -----------------------------------------------------------
def test_max_requests_on_a_sized_scenario_is_refused_with_what_to_do() -> None:
    for sc in ("burst", "mixed", "code"):
        with pytest.raises(LiveEvaluationError, match=r"max_requests=24 on a scenario sized to the machine .*"
                                                      r"too short for the gateway's control loop; .*duration_s"):
            _check(load_config([f"live_scenario={sc}", "live_scenario.max_requests=24", "out_dir=/tmp/x"],
                               config_name="live_evaluate"))
    for ok in (["live_scenario=burst", "live_scenario.max_requests=24", "live_scenario.load_multiple=null"],
               ["live_scenario=burst", "live_scenario.duration_s=20"],
               ["live_scenario.max_requests=24"]):  # steady is not sized
        _check(load_config([*ok, "out_dir=/tmp/x"], config_name="live_evaluate"))


# --- the rows name the trace window --------------------------------------------------------------
def test_rows_are_labelled_with_the_trace_and_window(tmp_path: Path) -> None:
    from batchpilot.evaluation.live_window import scenario_label

    def label(*ov: str) -> str:
        sc = load_config([*ov, "out_dir=/tmp/x"], config_name="live_evaluate").live_scenario
        return scenario_label(OmegaConf.to_container(sc, resolve=True), scenario_trace(sc))

    assert label() == "steady (azure_llm_2023_conv.csv, trace s 0-60, x1)"
    assert label("live_scenario.trace=data/traces/mooncake_synthetic.jsonl", "live_scenario.format=mooncake",
                 "live_scenario.start_s=100", "live_scenario.duration_s=30", "live_scenario.time_scale=2") == \
        "steady (mooncake_synthetic.jsonl, trace s 100-130, x2)"
    assert label("live_scenario.max_requests=12") == "steady (azure_llm_2023_conv.csv, trace s 0-60, x1, first 12 requests)"
    assert label("live_scenario.duration_s=null").endswith("trace s 0-end, x1)")
    lab = label()
    rows = []
    for rnd in range(2):
        for pos, path in enumerate(("vllm_direct", "pid")):
            row = row_from_result({"completed": 5, "failed": 0, "duration": 5.0, "request_goodput": 1.0 + pos},
                                  scenario=lab, path=path, rnd=rnd, position=pos, requests=5)
            rows.append({**row, "preemptions": 0.0, "peak_kv_usage": 0.1})
    md = write_results(rows, tmp_path, meta={}, plots=False)["md"].read_text()
    assert f"| {lab} | pid | 2 |" in md


# --- the twin: a cwd-relative trace, and no ppo path ---------------------------------------------
def test_twin_of_finds_a_cwd_relative_trace_and_says_when_there_is_no_gain(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run's folder whose trace was found in the current folder (``my.csv``): its twin
    is computed from the same folder (the simulator read relative traces from the repository only),
    and a run without ppo has one line where the gains table would be empty. The real simulator."""
    from batchpilot.evaluation.live_twin import twin_of

    monkeypatch.chdir(tmp_path)
    shutil.copy(AZURE, tmp_path / "my.csv")
    cfg = load_config(["live_scenario.trace=my.csv", "live_scenario.max_requests=8", "paths=[vllm_direct,pid]",
                       "twin_match=false", "out_dir=run"], config_name="live_evaluate")
    tf = scenario_trace(cfg.live_scenario)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml", resolve=True)
    rows = []
    for rnd in range(2):
        for pos, path in enumerate(("vllm_direct", "pid")):
            row = row_from_result({"completed": 8, "failed": 0, "duration": 4.0, "request_goodput": 2.0},
                                  scenario="steady", path=path, rnd=rnd, position=pos, requests=len(tf))
            row.update(preemptions=0.0, peak_kv_usage=0.1)
            rows.append(row)
    write_results(rows, run, meta={"scenario": OmegaConf.to_container(cfg.live_scenario), "requests_per_run": len(tf),
                                   "slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms}}, plots=False)
    out = twin_of("run", log=lambda *_: None)
    assert [r["path"] for r in out["rows"]] == ["vllm_direct", "pid"] and out["gains"] == []
    md = (run / "results.md").read_text()
    assert ("No gain to compare with live: the twin follows ppo − vllm_direct and ppo − pid, and this run's paths "
            "(vllm_direct, pid) have no ppo.") in md
    assert "| gain |" not in md
