"""The live evaluation's checks of what a type cannot say, run before anything is written or
started: the extra policy paths' folders, the gateway overrides that would replace the
evaluation's own settings, a sized scenario's request count, the client's headers and
concurrency, vllm_tuned's settings and tuning window, and the output folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchpilot.evaluation.live_errors import LiveEvaluationError
from batchpilot.evaluation.live_results import PATHS
from batchpilot.evaluation.live_tuned import (
    TunedConfigError,
    needs_prefill_probe,
    plan_settings,
    tuning_scenario,
)
from batchpilot.evaluation.plan import override_key


def check_policy_dir(name: str, folder: str) -> None:
    """Load ``policies.NAME``'s folder with the gateway's torch-free loader (manifest, weights,
    features, action space); its reason, naming the folder, as a ``LiveEvaluationError``."""
    from batchpilot.policies.artifact import PolicyLoadError
    from batchpilot.policies.runtime import PolicyRuntime

    try:
        PolicyRuntime.from_dir(folder)
    except (PolicyLoadError, OSError, ValueError) as e:
        raise LiveEvaluationError(f"policies.{name}: {e} (an exported policy folder is needed)") from None


def policy_dirs(cfg: DictConfig) -> dict[str, str]:
    """``policies``: more paths, each an exported policy the gateway runs in ``policy`` mode
    (e.g. ``{ppo_finetuned: outputs/finetune_live/run/policy}``); with any, ``ppo`` reloads the
    shipped policy before its runs. Folders are made absolute (the gateway runs elsewhere) and
    loaded here, as the gateway will load them, so a broken one fails before vLLM starts."""
    extra = {str(k): str(Path(str(v)).expanduser().resolve()) for k, v in cfg.policies.items()}
    clash = [k for k in extra if k in PATHS]
    if clash:
        raise LiveEvaluationError(f"policies may not redefine the built-in paths {clash}")
    for name, d in extra.items():
        check_policy_dir(name, d)
    if extra:
        from batchpilot.policies.ppo_controller import PRETRAINED_DIR

        extra = {"ppo": str(PRETRAINED_DIR), **extra}
    return extra


#: The gateway's settings the evaluation sets itself (``running_gateway``), and what to do instead.
OWNED_GATEWAY_KEYS: dict[str, str] = {
    "serve.managed": "drop it: the evaluation always runs a managed vLLM",
    "serve.port": "drop it: the evaluation picks a free port and waits on it",
    "serve.model": "set gateway.model instead",
    "serve.served_model_name": "set gateway.served_model_name instead",
    "serve.max_model_len": "set live_scenario.max_model_len instead",
    "serve.kv_cache_space_gib": "set gateway.kv_cache_space_gib instead",
    "serve.extra_vllm_args": "set gateway.extra_vllm_args or live_scenario.vllm_args instead",
    "serve.control.mode": "drop it: each path sets the gateway's mode (paths)",
    "serve.log_dir": "drop it: vLLM's logs are kept in out_dir, beside gateway.log",
    "slo.ttft_ms": "set live_evaluate's slo.ttft_ms instead (the client's goodput uses it too)",
    "slo.tpot_ms": "set live_evaluate's slo.tpot_ms instead (the client's goodput uses it too)",
}


def check_gateway_overrides(overrides: Sequence[Any]) -> None:
    """``gateway.overrides`` may not set what the evaluation sets itself: such an override
    would replace it silently (a ``serve.port`` one made the run wait out its whole start-up
    timeout on a port nothing listened on). A parent key (``serve=...``) counts too."""
    for o in map(str, overrides):
        key = override_key(o)
        hit = [k for k in OWNED_GATEWAY_KEYS if k == key or k.startswith(key + ".")]
        if hit:
            what = hit[0] if key == hit[0] else f"{key} (which holds {hit[0]})"
            raise LiveEvaluationError(f"gateway.overrides: {o!r} sets {what}, which the live evaluation sets "
                                      f"itself; {OWNED_GATEWAY_KEYS[hit[0]]}")


def check_sized_count(scenario: DictConfig) -> None:
    """``max_requests`` on a scenario sized to the machine (``load_multiple``) is refused: the
    sizing sets the rate (load_multiple x what vLLM serves here), so a fixed count of requests
    lasts count / rate seconds, under a second for a few dozen at the 30-75 req/s the sized
    scenarios reach here; the gateway's control loop (a tick a second) has nothing to act on,
    and the probe of so few requests at once is no saturated capacity either. A shorter sized
    run shortens the window instead (``duration_s``: the run lasts as long as written)."""
    n, m = scenario.get("max_requests"), scenario.get("load_multiple")
    if n is None or m is None:
        return
    name = scenario.get("name", "?")
    raise LiveEvaluationError(
        f"live_scenario.max_requests={n} on a scenario sized to the machine ({name!r}: load_multiple={m:g}): "
        f"the {n} requests would be replayed at {m:g} x what vLLM serves here, within {n} / ({m:g} x C) s "
        f"(C: the probe's req/s; {n / (m * 30):.2g} s at 30 req/s), too short for the gateway's control loop; "
        f"for a shorter sized run set live_scenario.duration_s (trace seconds, replayed for as long as written), "
        f"or live_scenario.load_multiple=null to replay the first {n} requests at the written rate")


def check_client(client: Mapping[str, Any]) -> None:
    """``client.headers`` and ``client.max_concurrency`` as vLLM's client takes them, checked
    before vLLM starts (its client raised only at the first run, minutes later)."""
    for h in client.get("headers") or []:
        key, eq, value = str(h).partition("=")
        if not eq or not key.strip():
            raise LiveEvaluationError(f"client.headers: {str(h)!r} is not KEY=VALUE")
        if key.strip().lower() == "x-priority":  # the twin reads it as the gateway does: an integer
            try:
                int(value.strip())
            except ValueError:
                raise LiveEvaluationError(f"client.headers: {str(h)!r}: x-priority must be an integer") from None
    mc = client.get("max_concurrency")
    if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 1):
        raise LiveEvaluationError(f"client.max_concurrency must be null (open loop) or an integer >= 1, got {mc!r}")


def check_tuned(cfg: DictConfig) -> tuple[list[dict[str, Any]], bool, dict[str, Any] | None]:
    """``vllm_tuned``: its settings (the fixed ``flags``, or the sweep's grid, at most
    ``max_settings``), its floor, and for a sweep the tuning window as written (disjoint from
    the scored window). Returns (settings, given, the tuning scenario or None)."""
    node = cfg.vllm_tuned
    try:
        settings, given = plan_settings(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
        floor = float(node.attainment_floor)
        if not 0.0 <= floor <= 1.0:
            raise TunedConfigError(f"vllm_tuned.attainment_floor={floor} must be within 0 and 1")
        if int(node.prefill_probe_requests) < 1:
            raise TunedConfigError(f"vllm_tuned.prefill_probe_requests={node.prefill_probe_requests} must be >= 1")
        sc = OmegaConf.to_container(cfg.live_scenario, resolve=True)
        assert isinstance(sc, dict)
        tuning = (None if given and not needs_prefill_probe(settings)  # the window a sweep or a prefill probe reads
                  else tuning_scenario(sc, OmegaConf.to_container(node.tuning, resolve=True)))  # type: ignore[arg-type]
    except TunedConfigError as e:
        raise LiveEvaluationError(str(e)) from None
    return settings, given, tuning


def check_out_dir(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is not a folder (an existing file, or under one) and a folder
    that already holds a run: a rerun would overwrite results.* but leave the old run's
    ``runs/`` logs and twin.json beside them, two runs mixed in one folder. An existing folder
    without a run is fine (nothing is written to it before the checks pass)."""
    for p in (out_dir, *out_dir.parents):
        if p.exists():
            if not p.is_dir():
                raise LiveEvaluationError(f"out_dir {out_dir}: {p} is a file, not a folder; pick another out_dir")
            break
    runs = out_dir / "runs"
    held = [p.name for p in (out_dir / "results.json",) if p.exists()]
    if runs.is_dir() and any(runs.iterdir()):
        held.append("runs/")
    if held:
        raise LiveEvaluationError(f"out_dir {out_dir} already holds a run ({', '.join(held)}); pick a new out_dir "
                                  f"(twin_of={out_dir} recomputes only its simulated twin)")
