"""Building an engine from the composed config: ``engine=sim`` (default) or ``engine=vllm``."""

from __future__ import annotations

from typing import Callable

from omegaconf import DictConfig, OmegaConf

from batchpilot.core.engine import Engine


def build_engine(cfg: DictConfig) -> Engine:
    """The engine ``cfg.engine.kind`` names, for ``cfg.model`` on ``cfg.hardware``."""
    kind = cfg.engine.kind
    if kind == "sim":
        from batchpilot.envs.sim_engine import SimEngine

        return SimEngine.from_cfg(cfg)
    if kind == "vllm":
        # Imported lazily: vLLM takes seconds to import and is an optional extra.
        from batchpilot.envs.vllm_engine import VLLMEngine

        return VLLMEngine.from_cfg(cfg)
    raise ValueError(f"engine.kind must be 'sim' or 'vllm', got {kind!r} (set engine=sim|vllm)")


class EngineFactory:
    """``build_engine`` for an environment that builds a fresh engine every episode: the
    simulator's specs are checked against their schemas once per distinct model/hardware
    (``from_node`` costs ~15 ms each, a third of a 120-step episode) and reused after. ``model``
    and ``hardware`` (nodes) replace ``cfg``'s: deployment randomisation draws them per episode;
    ``engine`` (a node) replaces ``cfg.engine`` (``env.memory_utilization`` draws one)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self._makers: dict[str, Callable[[], Engine]] = {}

    def __call__(self, model: DictConfig | None = None, hardware: DictConfig | None = None, *,
                 engine: DictConfig | None = None) -> Engine:
        c = self.cfg
        if c.engine.kind != "sim":
            if model is not None or hardware is not None or engine is not None:
                raise ValueError("another model/hardware/engine node needs the simulator (engine=sim)")
            return build_engine(c)
        model = c.model if model is None else model
        hardware = c.hardware if hardware is None else hardware
        engine = c.engine if engine is None else engine
        # The nodes' resolved contents as the key: ``repr`` of plain containers tells apart what
        # ``to_yaml`` did (1 from 1.0 from "1") at a twentieth of its cost (~0.3 ms against ~7 ms
        # a reset, which was 6 % of a 120-step episode).
        key = repr([OmegaConf.to_container(node, resolve=True) for node in (engine, model, hardware)])
        if key not in self._makers:
            from batchpilot.core.specs import HardwareSpec, ModelSpec
            from batchpilot.envs.sim_engine import SimEngine
            from batchpilot.schemas.engine import SimEngineConfig

            parts = (HardwareSpec.from_cfg(hardware), ModelSpec.from_cfg(model), SimEngineConfig.from_cfg(engine))
            self._makers[key] = lambda: SimEngine(*parts)
        return self._makers[key]()
