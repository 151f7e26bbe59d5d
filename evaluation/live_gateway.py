"""The gateway the live evaluation runs through: ``scripts/serve.py serve.managed=true`` (the
gateway and the ``vllm serve`` it owns) started in its own process group and stopped with it, its
admin API (status, mode, knobs, KV dtype, reset, decisions), and the state each path starts from
(``prepare_path``: start-up KV dtype and knobs, the path's controller, fresh control state)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
from omegaconf import DictConfig

from batchpilot.config import REPO_ROOT
from batchpilot.evaluation.live_errors import LiveEvaluationError, wait_until
from batchpilot.serving.upstream import free_port

#: The gateway's control mode for each gateway path.
GATEWAY_MODE = {"static": "static", "pid": "pid", "ppo": "policy"}


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen
    token: str
    log_path: Path
    initial_knobs: dict[str, Any] = field(default_factory=dict)

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/status", headers=self._headers(), timeout=10)
        r.raise_for_status()
        return r.json()

    def admin(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/admin/{path}", json=dict(body), headers=self._headers(), timeout=30)
        if r.status_code != 200:
            raise LiveEvaluationError(f"gateway /admin/{path} {dict(body)} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def decisions(self, since: int) -> list[dict[str, Any]]:
        """The control loop's decisions after tick ``since`` (``GET /admin/decisions``)."""
        r = httpx.get(f"{self.url}/admin/decisions", params={"since": since}, headers=self._headers(), timeout=30)
        r.raise_for_status()
        return list(r.json()["decisions"])

    def lane(self) -> dict[str, Any]:
        lanes = self.status()["control"]["lanes"]
        if len(lanes) != 1:
            raise LiveEvaluationError(f"the live evaluation drives one upstream; the gateway has {len(lanes)}")
        return next(iter(lanes.values()))

    def upstream(self) -> dict[str, Any]:
        ups = self.status()["upstreams"]
        return next(iter(ups.values()))

    def exited(self) -> str | None:
        if self.proc.poll() is not None:  # (the error adds the log's last lines and vLLM's log)
            return f"the gateway exited with code {self.proc.returncode}"
        return None


@contextlib.contextmanager
def running_gateway(cfg: DictConfig, scenario: DictConfig, model_dir: Path, served_name: str,
                    log_path: Path) -> Iterator[GatewayProcess]:
    """``scripts/serve.py serve.managed=true`` on a free port, in its own process group; on
    exit SIGTERM, then SIGKILL, the gateway and the vLLM process group it owns. The gateway runs
    under ``batchpilot.serving.reaper`` (the group's leader), which ends the group when this
    process is gone however it ended (SIGKILL included), so no gateway or vLLM outlives it."""
    g = cfg.gateway
    port = free_port()
    folder = log_path.parent.resolve()  # absolute: the gateway runs in the repository
    token = secrets.token_hex(16)
    vllm_args = [*g.extra_vllm_args, *scenario.vllm_args]
    overrides = [
        "serve.managed=true", f"serve.port={port}", f"serve.model={model_dir}",
        f"serve.served_model_name={served_name}", f"serve.max_model_len={scenario.max_model_len}",
        f"serve.kv_cache_space_gib={g.kv_cache_space_gib}",
        "serve.extra_vllm_args=[" + ",".join(json.dumps(str(a)) for a in vllm_args) + "]",
        "serve.control.mode=static", f"slo.ttft_ms={cfg.slo.ttft_ms}", f"slo.tpot_ms={cfg.slo.tpot_ms}",
        # vLLM's logs beside gateway.log (the gateway's default is a /tmp folder nobody removes);
        # Hydra writes nothing there (no output subdir, no job log): its run dir is only made.
        f"serve.log_dir={folder}", f"hydra.run.dir={folder}", "hydra.output_subdir=null",
        "hydra/job_logging=none", "hydra/hydra_logging=none", *g.overrides,
    ]
    reaper = [sys.executable, "-m", "batchpilot.serving.reaper", str(os.getpid()), "--"]
    cmd = [*reaper, sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), *overrides]
    env = dict(os.environ, BATCHPILOT_ADMIN_TOKEN=token, VLLM_CPU_KVCACHE_SPACE=str(g.kv_cache_space_gib))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, process_group=0)
    gw = GatewayProcess(f"http://127.0.0.1:{port}", proc, token, log_path)
    pids: list[int] = []
    try:
        wait_until(lambda: httpx.get(f"{gw.url}/readyz", timeout=2).status_code == 200, g.startup_timeout_s,
                   "the gateway's /readyz (gateway.startup_timeout_s)", poll_s=0.5, alive=gw.exited, log=log_path)
        pid = gw.upstream().get("pid")
        pids = [pid] if pid else []
        gw.initial_knobs = dict(gw.lane()["knobs_in_force"])
        yield gw
    finally:
        with contextlib.suppress(Exception):
            pid = gw.upstream().get("pid")
            pids = [pid] if pid else pids
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in pids:  # the vLLM process group, if the gateway did not end it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def gateway_idle(gw: GatewayProcess) -> bool:
    lane = gw.lane()
    return lane["in_flight"] == 0 and sum(lane["queue_depths"]) == 0 and lane["healthy"] and not lane["restarting"]


def prepare_path(gw: GatewayProcess, path: str, timeout_s: float, policy_dir: str | None = None) -> None:
    """Put the gateway in the state a path starts from: start-up KV dtype and knobs, the
    path's controller (``static`` while ``vllm_direct`` runs) and fresh control state
    (``/admin/reset``: breaker, controllers' memory, telemetry windows). ``policy_dir``: a policy path's
    artifact, loaded into the gateway first (``/admin/policy/reload``, no canary)."""
    init = gw.initial_knobs
    if gw.lane()["knobs_in_force"].get("kv_dtype") != init.get("kv_dtype"):
        gw.admin("kv_dtype", {"dtype": init["kv_dtype"], "force": True})
        wait_until(lambda: gw.lane()["knobs_in_force"].get("kv_dtype") == init["kv_dtype"] and gateway_idle(gw),
                   timeout_s, f"the KV dtype back to {init['kv_dtype']}", alive=gw.exited, log=gw.log_path)
    gw.admin("mode", {"mode": "static"})
    gw.admin("freeze", {"frozen": False, "force": True,
                        "knobs": {"batch_cap": init["batch_cap"], "bucketing": init["bucketing"]}})
    if policy_dir is not None:
        gw.admin("policy/reload", {"path": policy_dir, "canary_share": 0.0})
    mode = "policy" if policy_dir is not None else GATEWAY_MODE.get(path, "static")
    out = gw.admin("mode", {"mode": mode})
    if mode == "policy" and out.get("acting") != "policy":
        raise LiveEvaluationError(f"the gateway would not run the policy (acting={out.get('acting')}, "
                                  f"fallback: {out.get('fallback_reason')})")
    # Not under the last run's breaker, PID integral or latency windows.
    gw.admin("reset", {"force": True})
