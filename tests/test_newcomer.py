"""A newcomer's first run, from the README alone: the quick start's commands are read out of
README.md's code blocks and run as written. The shipped policy is served by ``batchpilot serve``
in front of a running tiny ``vllm serve`` (the "existing vLLM": here started by the test), one
completion goes through the OpenAI client example, and the README's own check shows the policy
in control (``/metrics``), as ``/admin/status`` and the decision log do.

Only what cannot be the README's is changed: the upstream's URL and the gateway's port (free
ports instead of 8001 / 8000), and where the run writes its Hydra folder.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from gateway_helpers import AUTH, TOKEN, stop_process, wait_ready, wait_until

from batchpilot.config import REPO_ROOT, load_config
from batchpilot.schemas.serve import ServeConfig
from batchpilot.serving.upstream import ManagedVLLM, free_port

README = REPO_ROOT / "README.md"
#: The addresses the README's quick start uses for the existing vLLM and for the gateway.
README_UPSTREAM = "http://127.0.0.1:8001"
README_GATEWAY = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class QuickStart:
    """The quick start's commands, as the README writes them."""

    train: str
    serve: str
    client: str
    check: str


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def _command(blocks: list[str], prefix: str) -> str:
    """The one command line of the bash blocks that starts with ``prefix`` (comment dropped)."""
    lines = [ln.split("  #")[0].strip() for b in blocks for ln in b.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"README quick start: expected one '{prefix}...' command, found {lines}"
    return lines[0]


def quick_start() -> QuickStart:
    """Read the quick start's commands out of README.md."""
    section = _section(README.read_text(encoding="utf-8"), "Quick start")
    bash, python = _blocks(section, "bash"), _blocks(section, "python")
    assert len(python) == 1, "README quick start: expected one python block (the OpenAI client example)"
    return QuickStart(train=_command(bash, "batchpilot train"), serve=_command(bash, "batchpilot serve"),
                      client=python[0], check=_command(bash, "curl"))


def test_the_quick_start_serves_the_shipped_policy_in_policy_mode() -> None:
    """Fast: the README's serve command, composed as the gateway composes it, names the shipped
    policy and starts policy mode without the reader setting the mode; its client example and
    its check talk to the gateway the command starts (port 8000 by default)."""
    qs = quick_start()
    argv = shlex.split(qs.serve)
    assert argv[:2] == ["batchpilot", "serve"] and not any(a.startswith("serve.control.mode") for a in argv)
    serve = ServeConfig.from_cfg(load_config(argv[2:], config_name="serve_app").serve)
    assert serve.control.mode == "policy" and serve.upstreams == [README_UPSTREAM]
    assert (REPO_ROOT / str(serve.control.policy_dir) / "manifest.json").is_file()
    assert f"{README_GATEWAY}/v1" in qs.client and serve.port == 8000
    assert f"{README_GATEWAY}/metrics" in qs.check
    assert shlex.split(qs.train)[:2] == ["batchpilot", "train"]


@pytest.fixture(scope="module")
def upstream(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedVLLM]:
    """The reader's existing ``vllm serve``: the tiny model on a free port."""
    log = tmp_path_factory.mktemp("newcomer-vllm") / "vllm.log"
    vllm = ManagedVLLM(str(tiny_model_path), free_port(), served_model_name="tiny-llama", max_model_len=2048,
                       max_num_seqs=64, kv_cache_space_gib=1, extra_args=["--enforce-eager"], log_path=log)
    vllm.start()
    try:
        def up() -> bool:
            assert vllm.alive(), f"vllm serve exited during start-up; see {log}"
            try:
                return httpx.get(f"{vllm.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 420, f"vllm serve on {vllm.url} healthy (log: {log})", poll_s=1.0)
        yield vllm
    finally:
        vllm.close()


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_newcomer_serves_the_shipped_policy_from_the_readme(upstream: ManagedVLLM, tmp_path: Path) -> None:
    qs = quick_start()
    exe = shutil.which("batchpilot", path=str(Path(sys.executable).parent))
    assert exe is not None, "no batchpilot script beside this Python: run `pip install --no-deps -e .`"
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    argv = shlex.split(qs.serve.replace(README_UPSTREAM, upstream.url))
    cmd = [exe, *argv[1:], f"serve.port={port}", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, "BATCHPILOT_ADMIN_TOKEN": TOKEN})
    try:
        wait_ready(gateway, 420, proc)
        # The OpenAI client example, as written, against this gateway.
        ns: dict[str, object] = {}
        exec(compile(qs.client.replace(README_GATEWAY, gateway), "README.md (quick start)", "exec"), ns)
        completion = ns["completion"]
        assert completion.model == "tiny-llama" and completion.usage.completion_tokens >= 1  # type: ignore[attr-defined]
        # It went through the gateway, answered 200.
        metrics = httpx.get(f"{gateway}/metrics", timeout=30).text
        assert re.search(r'^batchpilot:requests_total\{route="/v1/completions",status="200"\} [1-9]', metrics, re.M), \
            "the completion did not go through the gateway"
        # The README's check, run as written (curl | grep: status 0 when the policy acts).
        check = subprocess.run(qs.check.replace(README_GATEWAY, gateway), shell=True, capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0 and check.stdout.rstrip().endswith(" 1.0"), (check.stdout, check.stderr)
        status = httpx.get(f"{gateway}/admin/status", headers=AUTH, timeout=30).json()["control"]
        assert (status["mode"], status["acting"], status["fallback_reason"]) == ("policy", "policy", None), status
        assert Path(status["policy_path"]).resolve() == (REPO_ROOT / "policies" / "pretrained").resolve()
        # And its decisions are the policy's (counted, not slept: ticks come when the machine allows).
        wait_until(lambda: any(r["acting"] == "policy" for r in _decisions(gateway)), 120,
                   "a control decision taken by the policy")
    except BaseException as exc:
        exc.add_note(f"gateway log: {log_path}; command: {shlex.join(cmd)}")
        raise
    finally:
        stop_process(proc)
    assert "Exception in ASGI application" not in log_path.read_text(errors="replace")


def _decisions(url: str) -> list[dict[str, object]]:
    return httpx.get(f"{url}/admin/decisions", headers=AUTH, timeout=30).json()["decisions"]
