"""Deployment randomisation for training (``env.deployments``).

A policy trained on one model and GPU learns that model's rates. Drawing the deployment per
episode (every ``conf/model`` × ``conf/hardware`` pair listed: MLA, tensor parallelism and
their restart costs included) makes the scale-free signals (queues, latency against the SLO,
KV use) the ones that pay. Each deployment's load is the workload's, multiplied by its
capacity over the config's own deployment (``envs/capacity.py``, measured once per pair and
process on the workload's seed-0 lengths), so every pair sees the same share of its capacity.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from batchpilot.config import load_config
from batchpilot.envs.capacity import saturated_rate
from batchpilot.envs.engines import EngineFactory


@dataclass(frozen=True)
class Deployment:
    """One model on one hardware, and the workload sized for it."""

    label: str
    model: DictConfig
    hardware: DictConfig
    #: The workload node with ``rate_scale`` multiplied by ``load_multiplier``.
    workload: DictConfig
    #: capacity(this deployment) / capacity(the config's own), on the same requests.
    load_multiplier: float


def parse_label(text: str) -> tuple[str, str]:
    """``"model/hardware"`` -> ``(model, hardware)``; a clear error otherwise."""
    parts = str(text).split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"env.deployments: {text!r} is not MODEL/HARDWARE (e.g. llama3_8b/h100)")
    return parts[0], parts[1]


#: (engine, model, hardware, workload) yaml -> saturated requests/s, per process.
_CAPACITY: dict[str, float] = {}


def _capacity(cfg: DictConfig, model: DictConfig, hardware: DictConfig, factory: EngineFactory) -> float:
    from batchpilot.envs.workloads import build_workload

    key = OmegaConf.to_yaml(OmegaConf.create(
        {"e": cfg.engine, "m": model, "h": hardware, "w": cfg.workload}), resolve=True)
    if key not in _CAPACITY:
        engine = factory(model, hardware)
        try:
            caps = engine.capabilities()
            stream = build_workload(cfg.workload, np.random.default_rng(0), caps.max_model_len)
            _CAPACITY[key] = saturated_rate(engine, stream.pop_until(float("inf")), caps.max_num_seqs)
        finally:
            engine.close()
    return _CAPACITY[key]


class DeploymentSet:
    """The pairs of ``cfg.env.deployments``, composed and sized once."""

    def __init__(self, cfg: DictConfig, factory: EngineFactory) -> None:
        if cfg.engine.kind != "sim":
            raise ValueError("env.deployments needs the simulator (engine=sim): a live engine runs its own model")
        ref = _capacity(cfg, cfg.model, cfg.hardware, factory)
        self.deployments: list[Deployment] = []
        for text in cfg.env.deployments:
            model, hardware = parse_label(text)
            try:
                nodes = load_config([f"model={model}", f"hardware={hardware}"])
            except Exception as exc:  # Hydra's MissingConfigException, schema errors
                raise ValueError(f"env.deployments: {text!r}: {exc}") from exc
            mult = _capacity(cfg, nodes.model, nodes.hardware, factory) / ref
            workload = copy.deepcopy(cfg.workload)
            with open_dict(workload):
                workload.rate_scale = float(workload.get("rate_scale", 1.0)) * mult
            self.deployments.append(Deployment(str(text), nodes.model, nodes.hardware, workload, mult))

    def draw(self, rng: np.random.Generator) -> Deployment:
        return self.deployments[int(rng.integers(len(self.deployments)))]

    def __repr__(self) -> str:
        return ", ".join(f"{d.label} x{d.load_multiplier:.3g}" for d in self.deployments)
