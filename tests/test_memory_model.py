"""One memory model (issue 14): the simulator, the live engine and the gateway size KV with the
core's one formula (``core.engine.ModelMemory``, MLA included), fed from the deployment's model
and the engine's real KV pool. The gateway used to count blocks against the pool alone (its
80 % admitted 2.3x what the simulator would on DeepSeek/H200) and invented 16,384 blocks when
``/metrics`` lacked the cache info; an unknown budget now holds the safe static cap, loudly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from test_control_parity import _gateway, _metrics_text, recorded_trace

from batchpilot.config import load_config
from batchpilot.core.engine import KV_DTYPES_ALL, ModelMemory
from batchpilot.core.shield import Shield, ShieldConfig
from batchpilot.core.specs import ModelSpec
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.serving.control_loop import ControlLoop, deployment_model, upstream_engine_model
from batchpilot.serving.upstream import EngineInfo

#: DeepSeek-V3's config.json, the fields that size its KV cache (MLA) and its weights' dtype.
DEEPSEEK_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "num_attention_heads": 128,
                   "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                   "v_head_dim": 128, "torch_dtype": "bfloat16"}


def _deepseek_folder(tmp_path: Path) -> Path:
    d = tmp_path / "DeepSeek-V3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DEEPSEEK_CONFIG))
    with open(d / "model.safetensors", "wb") as f:  # sparse: 671 GB of fp8 weights, no disk used
        f.truncate(671 * 10**9)
    return d


def test_the_formula_is_the_specs_and_the_deployment_configs(tmp_path: Path) -> None:
    spec = ModelSpec.from_cfg(load_config(["model=deepseek_v3"]).model)
    model, source = deployment_model(str(_deepseek_folder(tmp_path)), tensor_parallel=8)
    assert model is not None and source.endswith("DeepSeek-V3")
    assert model.kv_latent_dim == 576 and model.num_layers == 61
    for d in KV_DTYPES_ALL:
        assert model.kv_block_bytes(d, 64) == spec.kv_block_bytes(d, 64), d
    assert model.weights_bytes == spec.weights_bytes_per_rank
    # A Llama (GQA) config: K/V heads per rank.
    llama = ModelMemory.from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                        "hidden_size": 4096}, tensor_parallel=2)
    assert llama.kv_bytes_per_token_layer("auto") == 2 * 4 * 128 * 2


def test_the_gateway_admits_what_the_simulator_would_on_deepseek_h200(tmp_path: Path) -> None:
    cfg = load_config(["hardware=h200", "model=deepseek_v3"])
    sim = SimEngine.from_cfg(cfg)
    sim_mem = sim.memory_model()
    gw, loop = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.upstream.info = EngineInfo(model="deepseek", max_model_len=131072, num_kv_blocks=sim_mem.num_kv_blocks_total,
                                    block_size=sim_mem.block_size, kv_dtype="auto")
    model, _ = deployment_model(str(_deepseek_folder(tmp_path)), tensor_parallel=8)
    shield_cfg = ShieldConfig.from_cfg(gw.settings.shield)
    ctx = 2048
    caps = sim.capabilities()

    def feasible(mem) -> int:
        sh = Shield(shield_cfg, mem, caps, gw.settings.slo)
        sh.context_len = ctx
        return sh.max_feasible_batch("auto")

    gw_mem, _ = upstream_engine_model(lane, 256, managed=False, model=model)
    pool_only, _ = upstream_engine_model(lane, 256, managed=False)
    assert gw_mem.source == "model" and pool_only.source == "kv_pool"
    n_sim, n_gw, n_pool = feasible(sim_mem), feasible(gw_mem), feasible(pool_only)
    # The pool-only count (the old gateway) admits far more than the simulator; the one model
    # lands within the activation workspace the gateway cannot see (a few %), never below.
    print(f"feasible caps at {ctx} tokens: simulator {n_sim}, gateway {n_gw}, KV pool alone {n_pool}")
    assert n_pool > 1.8 * n_sim, (n_pool, n_sim)
    assert n_sim <= n_gw <= 1.10 * n_sim, (n_gw, n_sim)


def test_an_unknown_kv_budget_holds_the_safe_cap_and_says_so() -> None:
    """``/metrics`` without ``vllm:cache_config_info``: no invented 16,384 blocks; the cap heads
    for serve.control.safe_batch_cap within the step limit, with a status field, a metric and a
    note, and admission's per-request check is off (nothing to check against)."""
    gw, _ = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048)  # no num_gpu_blocks / block_size
    loop = ControlLoop(gw)
    ctl = loop.lane_ctl[lane.index]
    assert not ctl.shield.memory.known and lane.admission.memory is None
    assert gw.metrics.memory_model_known.labels(lane.name)._value.get() == 0.0
    assert any("memory budget of vllm0 unknown" in e for e in loop.events)
    text = _metrics_text(recorded_trace()[0])

    async def metrics(timeout_s: float = 2.0) -> str:
        return text

    lane.upstream.metrics_text = metrics
    caps = [lane.knobs.batch_cap]
    for i in range(12):
        asyncio.run(loop.tick(lane, now=3000.0 + i))
        caps.append(lane.knobs.batch_cap)
        assert caps[-1] <= caps[-2]
        assert caps[-2] - caps[-1] <= ctl.shield.max_step(caps[-2])
    assert caps[-1] == gw.cfg.control.safe_batch_cap, caps
    st = loop.status()["lanes"]["vllm0"]
    assert st["memory_model"].startswith("unknown") and "cache_config_info" in st["memory_model"]
    assert "memory_unknown" in ctl.last_decision["interventions"] or caps[-2] == caps[-1]
    # The engine reports its pool (e.g. after a restart): the model is rebuilt, the checks resume.
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=4096, block_size=16)
    asyncio.run(loop.tick(lane, now=4000.0))
    assert ctl.shield.memory.known and lane.admission.memory is ctl.shield
    assert gw.metrics.memory_model_known.labels(lane.name)._value.get() == 0.5  # the pool alone: no model config


def test_an_override_pool_is_counted_against_the_memory_the_engine_was_given() -> None:
    """``num_gpu_blocks_override`` (a pool smaller than what the engine holds): the budget is
    weights + the KV memory the gateway gave a managed engine, as the live env counts it, so the
    80 % ceiling does not hold the small pool at ~60 % (vLLM's preemption is its limit). Not
    managed, or no override: weights + the pool, as before."""
    from batchpilot.serving.upstream import _cache_config

    labels = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",num_gpu_blocks="96",'
              'num_gpu_blocks_override="96",gpu_memory_utilization="0.9"} 1.0')
    assert _cache_config(labels) == (96, 32, "auto", 96)
    assert _cache_config(labels.replace('num_gpu_blocks_override="96"', 'num_gpu_blocks_override="None"'))[3] is None
    gw, _ = _gateway("pid", {"kind": "pid"})
    lane = gw.lanes[0]
    model = ModelMemory.from_hf_config({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512},
                                       weights_bytes=50e6)
    pool = 96 * model.kv_block_bytes("auto", 32)
    given = 2.0**30
    lane.upstream.info = EngineInfo(model="m", max_model_len=2048, num_kv_blocks=96, block_size=32, kv_dtype="auto",
                                    num_kv_blocks_override=96)
    mem, _ = upstream_engine_model(lane, 256, managed=True, model=model, given_kv_bytes=given)
    assert mem.budget_bytes == 50e6 + given and "override" in mem.source and mem.known
    # Not managed (nothing given), then no override: weights + the pool.
    other, _ = upstream_engine_model(lane, 256, managed=True, model=model, given_kv_bytes=None)
    assert other.budget_bytes == 50e6 + pool and other.source == "model"
    lane.upstream.info.num_kv_blocks_override = None
    other, _ = upstream_engine_model(lane, 256, managed=True, model=model, given_kv_bytes=given)
    assert other.budget_bytes == 50e6 + pool and other.source == "model"
    # The whole pool in use stays under the ceiling with the given budget; with weights + pool it does not.
    shield_cfg = ShieldConfig.from_cfg(gw.settings.shield)
    assert (50e6 + pool) / mem.budget_bytes < shield_cfg.memory_ceiling < (50e6 + pool) / other.budget_bytes
