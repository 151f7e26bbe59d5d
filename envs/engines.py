"""Building an engine from the composed config: ``engine=sim`` (default) or ``engine=vllm``."""

from __future__ import annotations

from omegaconf import DictConfig

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
