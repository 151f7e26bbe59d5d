"""Live evaluation: a trace window replayed by vLLM's own benchmark client
(``vllm.benchmarks.serve``, ``--dataset-name timed_trace``) against a real ``vllm serve``,
straight and through the gateway under each controller, interleaved over rounds.

One managed gateway is started (``scripts/serve.py serve.managed=true``: the gateway and the
``vllm serve`` it owns, on the tiny model unless ``gateway.model`` says otherwise) and kept for
the whole run. Each round runs every path once, in an order that rotates between rounds so
that no path always runs first or last:

- ``vllm_direct``: the client at the ``vllm serve`` port itself (vLLM as shipped; the gateway
  is idle in ``static`` mode, its control loop still reads vLLM's /metrics once a second);
- ``vllm_tuned``: the client at a second managed ``vllm serve`` with vLLM's own limits
  (``--max-num-seqs``, ``--max-num-queued-tokens``, ...), swept on a tuning window of the
  trace disjoint from the scored one, or given (``evaluation/live_tuned.py``);
- ``static`` / ``pid`` / ``ppo``: the client at the gateway, whose controller is switched
  through its admin API (``/admin/mode``: static, pid, policy). Before each gateway path the
  knobs are reset at once to the start-up ones (``/admin/freeze`` with ``force``) and the KV
  dtype to the start-up one (``/admin/kv_dtype`` with ``force``, a managed restart), and the
  control state is reset (``/admin/reset``: breaker level, PID's integral, a policy's residual,
  the telemetry windows), so a path starts where the previous one started, not where it left the
  knobs or under its breaker and latency windows.

Every run replays the same window (same arrival times and lengths) with its own ``hash_ids``
salt, so no run hits the prompts another run left in vLLM's prefix cache. Between runs the
evaluation waits until vLLM has no request running or waiting (a condition, not a sleep).

Rows (one per round × path) carry the client's own metrics (goodput with ``--goodput
ttft:<slo> tpot:<slo>`` from ``conf/slo``), the accounting (requests = completed + failed), and
vLLM's preemptions, peak KV usage, iterations (and their mean tokens) and mean wait in its own
queue from its /metrics. Out: results.json, results.csv,
results.md (mean ± 95 % CI per path and the paired per-round difference to ``vllm_direct``),
goodput.png and per-run client logs under ``runs/``. The gateway is a process, reached over HTTP;
only vllm_tuned's engine is started with the gateway's own launcher (``ManagedVLLM``), so that it
differs from the gateway's engine by its flags alone.

This module is the app: its config checked (``_check``), the rounds and paths interleaved
(``schedule``), the run put together and its results written as it goes. The parts it drives
live beside it: ``live_checks`` (the checks a type cannot say), ``live_gateway`` (the managed
gateway and its admin API), ``live_client`` (one replay by vLLM's benchmark client, and its row),
``live_driver`` (one run on one path), ``live_probes`` (the capacity probe and vllm_tuned's sweep),
``live_errors`` (the errors and the waits that say why).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from batchpilot.config import CONF_DIR
from batchpilot.core.telemetry import SLO
from batchpilot.envs.timed_trace import TimedTraceFile
from batchpilot.evaluation.live_checks import (
    check_client,
    check_gateway_overrides,
    check_out_dir,
    check_sized_count,
    check_tuned,
    policy_dirs,
)
from batchpilot.evaluation.live_client import row_from_result
from batchpilot.evaluation.live_driver import RunDriver
from batchpilot.evaluation.live_errors import LiveEvaluationError, LiveEvaluationInterrupted
from batchpilot.evaluation.live_gateway import running_gateway
from batchpilot.evaluation.live_probes import machine_load, tune_flags
from batchpilot.evaluation.live_results import BASELINE, PATHS, write_results
from batchpilot.evaluation.live_tuned import TUNED
from batchpilot.evaluation.live_window import scenario_label, scenario_trace
from batchpilot.nodes import from_node
from batchpilot.schemas import check_app
from batchpilot.schemas.live import LiveEvaluateApp, LiveScenarioConfig


def schedule(paths: Sequence[str], rounds: int, order: str = "rotate", seed: int = 0) -> list[list[str]]:
    """Path order per round. ``rotate``: round r starts at path r (mod n), so over n rounds
    every path runs once in every position; ``shuffle``: a seeded random order per round;
    ``fixed``: the given order every round."""
    paths = list(paths)
    if rounds < 1 or not paths:
        raise LiveEvaluationError(f"need rounds >= 1 and at least one path, got rounds={rounds}, paths={paths}")
    if order == "fixed":
        return [list(paths) for _ in range(rounds)]
    if order == "rotate":
        n = len(paths)
        return [paths[r % n:] + paths[: r % n] for r in range(rounds)]
    if order == "shuffle":
        rng = random.Random(seed)
        out = []
        for _ in range(rounds):
            p = list(paths)
            rng.shuffle(p)
            out.append(p)
        return out
    raise LiveEvaluationError(f"order must be rotate, shuffle or fixed, got {order!r}")


def _check(cfg: DictConfig) -> list[str]:
    """The run's paths. The keys and types were checked against ``schema/live_evaluate``
    (``batchpilot.schemas.live.LiveEvaluateApp``) at compose time; again here for a key added with
    ``+key=...``; then what a type cannot say (known, distinct paths; at least one round; the
    client's headers and concurrency; gateway overrides that would replace the evaluation's own)."""
    try:
        check_app(LiveEvaluateApp, cfg)
        from_node(LiveScenarioConfig, cfg.live_scenario)  # its values (a schema checks types only)
    except ValueError as e:
        raise LiveEvaluationError(str(e)) from None
    check_sized_count(cfg.live_scenario)
    paths = list(cfg.paths)
    known = (*PATHS, *policy_dirs(cfg))
    bad = [p for p in paths if p not in known]
    if bad or len(set(paths)) != len(paths):
        raise LiveEvaluationError(f"paths must be distinct names among {tuple(dict.fromkeys(known))}, got {paths}")
    if int(cfg.rounds) < 1:
        raise LiveEvaluationError(f"rounds must be >= 1, got {cfg.rounds}")
    check_client(cfg.client)
    check_gateway_overrides(cfg.gateway.overrides)
    if TUNED in paths:
        check_tuned(cfg)
    try:  # the client's --goodput and every controller's objectives
        SLO(ttft_ms=cfg.slo.get("ttft_ms"), tpot_ms=cfg.slo.get("tpot_ms"), e2el_ms=cfg.slo.get("e2el_ms"))
    except ValueError as e:
        raise LiveEvaluationError(str(e)) from None
    if cfg.slo.get("classes"):  # vLLM's client scores every request by one --goodput objective
        raise LiveEvaluationError(f"slo.classes={dict(cfg.slo.classes)}: the live evaluation replays one class and "
                                  "scores it with one objective (vLLM's --goodput); drop slo.classes here")
    lat = float(cfg.twin_ingress_latency_s)
    if not 0 <= lat < math.inf:  # checked before the runs, not when the twin starts after them
        raise LiveEvaluationError(f"twin_ingress_latency_s must be a finite number of seconds >= 0, got {lat}")
    hw_dir = CONF_DIR / "hardware"
    if not (hw_dir / f"{cfg.twin_hardware}.yaml").is_file():
        known = sorted(p.stem for p in hw_dir.glob("*.yaml"))
        raise LiveEvaluationError(f"twin_hardware={cfg.twin_hardware!r} is not a profile in conf/hardware; known: {known}")
    return paths


def live_evaluate(cfg: DictConfig, model_dir: Path | None = None) -> dict[str, Any]:
    """Run the live evaluation ``cfg`` (conf/live_evaluate.yaml) and write its files."""
    paths = _check(cfg)
    check_out_dir(Path(str(cfg.out_dir)))
    speed = None
    if cfg.sim_twin and cfg.twin_speed_of:  # read before the runs: a bad folder fails now, not after them
        from batchpilot.evaluation.live_twin import speed_of

        try:
            speed = speed_of(cfg.twin_speed_of)
        except ValueError as e:
            raise LiveEvaluationError(str(e)) from None
    pdirs = policy_dirs(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin/metrics poll otherwise
    scenario = cfg.live_scenario
    try:  # the trace window, read before anything is written or started
        tf = scenario_trace(scenario)
    except (OSError, ValueError) as e:
        raise LiveEvaluationError(f"live_scenario {scenario.get('name', '?')!r}: {e}") from None
    tuned_plan = check_tuned(cfg) if TUNED in paths else None
    if tuned_plan is not None and tuned_plan[2] is not None:
        try:  # the tuning window as written: not empty (its overlap with the scored one is checked)
            scenario_trace(OmegaConf.create(tuned_plan[2]))
        except (OSError, ValueError) as e:
            raise LiveEvaluationError(f"vllm_tuned.tuning (trace s {tuned_plan[2]['start_s']:g}-"
                                      f"{tuned_plan[2]['start_s'] + tuned_plan[2]['duration_s']:g}): {e}") from None
    order = schedule(paths, int(cfg.rounds), str(cfg.order), int(cfg.seed))
    out_dir = Path(str(cfg.out_dir))
    runs_dir = out_dir / "runs"
    try:  # the first thing written: every check has passed
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LiveEvaluationError(f"out_dir {out_dir}: cannot create it: {e.strerror or e}") from None
    save_run_config(cfg, out_dir)
    log_handler = logging.FileHandler(out_dir / "live_evaluate.log")
    log_handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(log_handler)
    try:
        return _live_evaluate(cfg, out_dir, order, pdirs, speed, tf, model_dir, tuned_plan)
    finally:
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()


def save_run_config(cfg: DictConfig, out_dir: Path) -> None:
    """``out_dir/.hydra/config.yaml`` (the composed config, resolved: what ``twin_of`` reads) and,
    under Hydra, ``overrides.yaml``: what Hydra writes itself, written here only once the checks
    have passed, so a refused run leaves nothing behind (conf/live_evaluate.yaml has Hydra write
    nothing)."""
    d = out_dir / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, d / "config.yaml", resolve=True)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        OmegaConf.save(HydraConfig.get().overrides.task, d / "overrides.yaml")


@dataclass
class _Progress:
    """What the run has so far: its rows, and the window, load and vllm_tuned meta as they are
    now (the sizing and the sweep replace them), for results written after every run."""

    cfg: DictConfig
    out_dir: Path
    order: list[list[str]]
    pdirs: Mapping[str, str]
    tf: TimedTraceFile
    rows: list[dict[str, Any]] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)
    sized: dict[str, Any] | None = None
    tuned_meta: dict[str, Any] = field(default_factory=dict)

    def meta(self, interrupted: bool = False) -> dict[str, Any]:
        return _meta(self.cfg, self.tf, self.order, self.pdirs, self.load, done=len(self.rows),
                     interrupted=interrupted, tuned=self.tuned_meta)

    def write(self, plots: bool = False, interrupted: bool = False) -> dict[str, Path]:
        return write_results(self.rows, self.out_dir, meta=self.meta(interrupted=interrupted), plots=plots)


def _model_dir(cfg: DictConfig, model_dir: Path | None) -> Path:
    """The model the gateway's vLLM serves: the caller's, ``gateway.model``, else the tiny one."""
    if model_dir is not None:
        return model_dir
    if cfg.gateway.model:
        return Path(str(cfg.gateway.model))
    from batchpilot.platform.tiny_model import build_tiny_model

    return build_tiny_model()


def _live_evaluate(cfg: DictConfig, out_dir: Path, order: list[list[str]], pdirs: Mapping[str, str],
                   speed: Mapping[str, Any] | None, tf: TimedTraceFile, model_dir: Path | None,
                   tuned_plan: tuple[list[dict[str, Any]], bool, dict[str, Any] | None] | None = None,
                   ) -> dict[str, Any]:
    """The run itself, into ``out_dir`` (made), after ``live_evaluate``'s checks: the gateway
    up, the warm-up, the sizing, vllm_tuned's flags and engine, the rounds, then the twin."""
    scenario = cfg.live_scenario
    print(f"live_evaluate: scenario {scenario.name}: {tf.summary}", flush=True)
    model_dir = _model_dir(cfg, model_dir)
    served = str(cfg.gateway.served_model_name)
    t_start = time.monotonic()
    prog = _Progress(cfg, out_dir, order, pdirs, tf)
    with partial_on_interrupt(lambda: prog.write(interrupted=True), lambda: len(prog.rows),
                              sum(map(len, order)), out_dir), \
            running_gateway(cfg, scenario, model_dir, served, out_dir / "gateway.log") as gw, \
            contextlib.ExitStack() as engines:
        vllm_url = gw.upstream()["url"]
        print(f"live_evaluate: gateway {gw.url}, vLLM {vllm_url}, up after {time.monotonic() - t_start:.0f} s",
              flush=True)
        runner = RunDriver(cfg, gw, vllm_url, tf, pdirs, model_dir, served, out_dir)
        runner.warm_up(("vllm_direct", "static"), tf.records)
        if scenario.load_multiple is not None:  # sized to this machine: a saturated probe first
            prog.load, prog.sized, prog.tf = machine_load(
                scenario, tf, lambda recs: runner.run(BASELINE, recs, "capacity_probe")[0])
            runner.tf = prog.tf
        if tuned_plan is not None:  # vllm_tuned: its flags (swept, or given), then its engine for the rounds
            _start_tuned(runner, prog, tuned_plan, engines)
        _run_rounds(runner, prog)
    files = prog.write(plots=bool(cfg.plots))
    if cfg.sim_twin:  # the same requests on the calibrated simulator (evaluation/live_twin.py)
        files["twin"] = _write_twin(cfg, prog, runner.client_cfg, speed)
    print(f"live_evaluate: {len(prog.rows)} runs in {time.monotonic() - t_start:.0f} s; files in {out_dir}",
          flush=True)
    print((out_dir / "results.md").read_text(), flush=True)
    return {"rows": prog.rows, "files": files, "trace": prog.tf}


def _start_tuned(runner: RunDriver, prog: _Progress,
                 tuned_plan: tuple[list[dict[str, Any]], bool, dict[str, Any] | None],
                 engines: contextlib.ExitStack) -> None:
    """vllm_tuned's flags (the sweep's pick, or the given ones), then its engine up and warmed
    for the rounds, kept in ``engines`` until they end."""
    settings, given, tuning_sc = tuned_plan
    prog.tuned_meta, chosen = tune_flags(runner.cfg, settings, given, tuning_sc, prog.sized, prog.tf, runner.run,
                                         runner.tuned_engine, runner.warm_tuned)
    prog.write()
    try:
        engines.enter_context(runner.tuned_engine(chosen))
    except RuntimeError as e:
        raise LiveEvaluationError(str(e)) from None
    runner.warm_tuned(prog.tf.records, "warmup_vllm_tuned")


def _run_rounds(runner: RunDriver, prog: _Progress) -> None:
    """Every round's paths in their order, a row each, the results rewritten after each run."""
    tf, scenario = prog.tf, runner.cfg.live_scenario
    label = scenario_label(prog.sized or OmegaConf.to_container(scenario, resolve=True), tf)
    for rnd, paths_r in enumerate(prog.order):
        for pos, path in enumerate(paths_r):
            res, extra = runner.run(path, tf.records, f"r{rnd}_{path}")
            row = row_from_result(res, scenario=label, path=path, rnd=rnd, position=pos,
                                  requests=len(tf))
            row.update(extra)
            prog.rows.append(row)
            print(f"live_evaluate: round {rnd} {path}: goodput {row['request_goodput']:.3f} req/s, "
                  f"{row['completed']}/{row['requests']} completed, {row['failed']} failed, "
                  f"preemptions {row['preemptions']:.0f}, wall {row['wall_s']:.0f} s", flush=True)
            prog.write()


def _write_twin(cfg: DictConfig, prog: _Progress, client_cfg: Mapping[str, Any],
                speed: Mapping[str, Any] | None) -> Path:
    """The runs' requests on the calibrated simulator, every path (vllm_tuned at the flags it ran
    with), into twin.json."""
    from batchpilot.evaluation.live_twin import header_priority, twin_of_rows, write_twin

    scenario, tf = cfg.live_scenario, prog.tf
    tuned_flags = (prog.tuned_meta.get("chosen") or {}).get("setting")
    sc = prog.sized or OmegaConf.to_container(scenario, resolve=True)  # the window the runs replayed
    assert isinstance(sc, dict)
    sc = {**sc, "trace": tf.source}  # the file read (the simulator resolves a relative one from the repo)
    twin, match = twin_of_rows(tf, sc, {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms}, prog.rows,
                               paths=[p for p in cfg.paths if p != TUNED or tuned_flags],
                               tuned_flags=tuned_flags, match=bool(cfg.twin_match),
                               match_gateway=bool(cfg.twin_match_gateway),
                               vllm_args=[*cfg.gateway.extra_vllm_args, *scenario.vllm_args],
                               priority=header_priority(client_cfg.get("headers"), 1), seed=int(cfg.seed),
                               policy_dirs={p: d for p, d in prog.pdirs.items() if p != "ppo"},
                               gateway_overrides=[str(o) for o in cfg.gateway.overrides],
                               speed=speed, ingress_latency_s=float(cfg.twin_ingress_latency_s),
                               hardware=str(cfg.twin_hardware))
    write_twin(prog.out_dir, twin, prog.rows, match=match, hardware=str(cfg.twin_hardware))
    return prog.out_dir / "twin.json"


@contextlib.contextmanager
def partial_on_interrupt(write: Callable[[], object], done: Callable[[], int], total: int,
                         out_dir: Path) -> Iterator[None]:
    """Ctrl-C inside: the finished runs written as partial results (``write``), then
    ``LiveEvaluationInterrupted``. Outside ``running_gateway``, so its cleanup has run first."""
    try:
        yield
    except KeyboardInterrupt:
        write()
        raise LiveEvaluationInterrupted(done(), total, out_dir) from None


def _meta(cfg: DictConfig, tf: TimedTraceFile, order: list[list[str]], pdirs: Mapping[str, str],
          load: Mapping[str, float], done: int = 0, interrupted: bool = False,
          tuned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """results.json's meta. ``complete``: every planned run is in (false while the run goes on,
    and in what an interrupted or killed run leaves). ``vllm_tuned``: its flags and the sweep."""
    total = sum(map(len, order))
    return {"complete": done == total and not interrupted, "runs_done": done, "runs_planned": total,
            "interrupted": interrupted,
            "scenario": OmegaConf.to_container(cfg.live_scenario, resolve=True), "trace": tf.summary,
            "requests_per_run": len(tf), "window_s": tf.duration_s, "order": order,
            "slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms},
            "warmup_requests": int(cfg.warmup.requests), "host_cpus": os.cpu_count(),
            "policies": dict(pdirs), "load": dict(load), **({"vllm_tuned": dict(tuned)} if tuned else {})}


__all__ = ["live_evaluate", "schedule"]
