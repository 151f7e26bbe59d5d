"""Closed-form time of one vLLM iteration, from batch aggregates.

Per layer: a soft roofline for the linear layers (weights read once per iteration, FLOPs
2 x active params x tokens / TP), memory-bound element-wise kernels, attention (decode reads
every running sequence's KV; prefill is quadratic in the chunk plus its prior context), the
TP all-reduces; per iteration: the LM head, a fixed overhead and a per-request overhead
(Vidur/BLIS style). Everything is a function of a few sums, so the simulator can add up
thousands of decode iterations in closed form: with ``n`` decoding sequences and no prefill,
``time = a(n) + b * sum_decode_context``.

Calibration: ``fit_linear`` / ``fit_elementwise`` fit the hardware factors to Vidur's
per-operator profiles (``python -m batchpilot.envs.step_time`` prints the fit for the
profiles in /work/shared/data); the numbers live in ``conf/hardware/*.yaml``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from batchpilot.core.engine import IterationShape
from batchpilot.core.specs import HardwareSpec, ModelSpec, is_8bit

_GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
_GEMMS_PER_LAYER = len(_GEMM_OPS)


# ---- per-layer pieces (vectorised over num_tokens) ----------------------------------------

def _moe_weight_fraction(model: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    """Expected fraction of a layer's weights an iteration reads: all of them for a dense
    model; for MoE, the chance an expert is touched by at least one of ``tokens`` tokens."""
    if not model.is_moe:
        return np.ones_like(tokens, dtype=float)
    a = model.layer_params_active / model.layer_params_total
    return 1.0 - (1.0 - a) ** np.maximum(tokens, 1)


def linear_layer_time(hw: HardwareSpec, model: ModelSpec, num_tokens: np.ndarray | int) -> np.ndarray:
    """Seconds for one layer's four GEMMs on one TP rank: soft roofline plus launch costs."""
    t = np.asarray(num_tokens, dtype=float)
    tp = model.tensor_parallel
    h, hd, nh, nkv, inter = (model.hidden_size, model.head_dim, model.num_heads,
                             model.num_kv_heads, model.intermediate_size)
    tile = hw.gemm_token_tile
    flops = 2.0 * np.ceil(t / tile) * tile * model.layer_params_active / tp
    w_bytes = model.bytes_per_param * model.layer_params_total * _moe_weight_fraction(model, t) / tp
    # Activations in/out of each GEMM (16-bit).
    act_elems = 4 * h + ((nh + 2 * nkv) * hd + nh * hd + 3 * inter) / tp
    a_bytes = 2.0 * t * act_elems
    c = flops / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
    m = (w_bytes + a_bytes) / (hw.hbm_tb_s * 1e12 * hw.memory_efficiency)
    p = hw.roofline_p
    return (c**p + m**p) ** (1.0 / p) + _GEMMS_PER_LAYER * hw.gemm_overhead_s


def elementwise_layer_time(hw: HardwareSpec, model: ModelSpec, num_tokens: np.ndarray | int) -> np.ndarray:
    """Seconds for one layer's norms, rope, activation and residual adds (memory bound),
    plus the fixed per-layer overhead."""
    t = np.asarray(num_tokens, dtype=float)
    tp = model.tensor_parallel
    h = model.hidden_size
    # norms: read+write h twice; adds: read 2h write h twice; act: read 2i write i; rope: q,k.
    elems = 4 * h + 6 * h + (3 * model.intermediate_size + 2 * (model.num_heads + model.num_kv_heads) * model.head_dim) / tp
    return 2.0 * t * elems / (hw.hbm_tb_s * 1e12 * hw.elementwise_efficiency) + hw.per_layer_overhead_s


def allreduce_layer_time(hw: HardwareSpec, model: ModelSpec, num_tokens: np.ndarray | int) -> np.ndarray:
    """Two ring all-reduces of the hidden state per layer under tensor parallelism."""
    t = np.asarray(num_tokens, dtype=float)
    tp = model.tensor_parallel
    if tp == 1:
        return np.zeros_like(t)
    nbytes = 2.0 * t * model.hidden_size
    return 2.0 * (hw.allreduce_latency_s + 2.0 * (tp - 1) / tp * nbytes / (hw.interconnect_gb_s * 1e9))


def lm_head_time(hw: HardwareSpec, model: ModelSpec, num_seqs: np.ndarray | int) -> np.ndarray:
    """Logits for the sampled position of each scheduled request (vLLM V1 computes only those)."""
    n = np.asarray(num_seqs, dtype=float)
    tp = model.tensor_parallel
    flops = 2.0 * n * model.vocab_size * model.hidden_size / tp
    w_bytes = model.bytes_per_param * model.vocab_size * model.hidden_size / tp
    c = flops / (hw.peak_tflops * 1e12 * hw.compute_efficiency)
    m = w_bytes / (hw.hbm_tb_s * 1e12 * hw.memory_efficiency)
    p = hw.roofline_p
    return np.where(n > 0, (c**p + m**p) ** (1.0 / p) + hw.gemm_overhead_s, 0.0)


# ---- the iteration model ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Coefficients of the iteration time for one (hardware, model, KV dtype).

    ``fixed[T]`` is the token-dependent part for ``T`` batched tokens (all layers);
    ``seq_cost[n]`` the per-sequence part (LM head + per-request overhead) for ``n`` scheduled
    sequences; ``decode_ctx_s`` the seconds per context token of decode attention;
    ``prefill_pair_s`` / ``prefill_ctx_s`` the prefill attention compute and KV-read costs."""

    fixed: tuple[float, ...]
    seq_cost: tuple[float, ...]
    decode_ctx_s: float
    prefill_pair_s: float
    prefill_ctx_s: float
    #: Extra seconds of an iteration with any prefill (``HardwareSpec.prefill_step_overhead_s``).
    prefill_step_s: float = 0.0

    @classmethod
    def build(cls, hw: HardwareSpec, model: ModelSpec, kv_dtype: str, max_tokens: int, max_seqs: int) -> "StepTimeModel":
        """Tabulate the model for up to ``max_tokens`` batched tokens and ``max_seqs`` sequences."""
        T = np.arange(max_tokens + 1)
        L = model.num_layers
        fixed = L * (linear_layer_time(hw, model, T) + elementwise_layer_time(hw, model, T)
                     + allreduce_layer_time(hw, model, T))
        fixed[0] = 0.0
        N = np.arange(max_seqs + 1)
        seq_cost = lm_head_time(hw, model, N) + hw.per_request_overhead_s * N
        seq_cost = seq_cost + np.where(N > 0, hw.per_step_overhead_s, 0.0)

        tp = model.tensor_parallel
        heads = model.num_heads // tp
        bw = hw.hbm_tb_s * 1e12 * hw.attn_memory_efficiency
        fl = hw.peak_tflops * 1e12 * hw.attn_compute_efficiency
        # KV read per context token per layer; 8-bit reads cost kv8_speed_factor x the 16-bit read.
        kv16 = model.kv_bytes_per_token_layer("auto")
        read_s = kv16 / bw * (hw.kv8_speed_factor if is_8bit(kv_dtype) else 1.0)
        width = model.kv_latent_dim if model.is_mla else model.head_dim
        decode_flop_s = 4.0 * heads * width / fl
        decode_ctx_s = L * max(read_s, decode_flop_s)
        prefill_pair_s = L * 4.0 * heads * model.head_dim / fl
        prefill_ctx_s = L * read_s
        k = hw.slowdown
        return cls(tuple(float(x) * k for x in fixed), tuple(float(x) * k for x in seq_cost),
                   float(decode_ctx_s) * k, float(prefill_pair_s) * k, float(prefill_ctx_s) * k,
                   float(hw.prefill_step_overhead_s) * k)

    def step_time(self, num_prefill_tokens: int, prefill_pairs: float, prefill_ctx: float,
                  num_decode: int, sum_decode_ctx: float, num_seqs: int) -> float:
        """Seconds of one iteration from its aggregates. ``prefill_pairs`` is the sum over
        prefill chunks of query-key pairs (``c * prior + c (c + 1) / 2``), ``prefill_ctx`` the
        sum of their prior+chunk context tokens, ``sum_decode_ctx`` the decode context sum."""
        t = self.fixed[num_prefill_tokens + num_decode] + self.seq_cost[num_seqs] + self.decode_ctx_s * sum_decode_ctx
        if num_prefill_tokens:
            t += max(self.prefill_pair_s * prefill_pairs, self.prefill_ctx_s * prefill_ctx) + self.prefill_step_s
        return t

    def iteration_time(self, it: IterationShape) -> float:
        """Seconds this model gives an iteration the live engine ran (its measured time aside)."""
        if it.num_prefill_tokens + it.num_decode >= len(self.fixed) or it.num_seqs >= len(self.seq_cost):
            raise ValueError(f"an iteration of {it.num_prefill_tokens + it.num_decode} tokens and "
                             f"{it.num_seqs} sequences is past this model's budget "
                             f"({len(self.fixed) - 1} tokens, {len(self.seq_cost) - 1} sequences)")
        return self.step_time(it.num_prefill_tokens, it.prefill_pairs, it.prefill_ctx,
                              it.num_decode, it.sum_decode_ctx, it.num_seqs)

    def decode_coeffs(self, n: int) -> tuple[float, float]:
        """``(a, b)`` with pure-decode iteration time ``a + b * sum_decode_ctx`` for ``n`` sequences."""
        return self.fixed[n] + self.seq_cost[n], self.decode_ctx_s


# ---- calibration ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One row of a Vidur ``mlp.csv``: medians in seconds for one layer on one rank."""

    num_tokens: int
    tensor_parallel: int
    linear_s: float
    elementwise_s: float
    model: ModelSpec


def load_vidur_mlp(path: str | Path) -> list[ProfileRow]:
    """Read a Vidur ``mlp.csv``; the model dims come from its ``n_head``/``n_embd``/... columns."""
    rows: list[ProfileRow] = []
    models: dict[tuple, ModelSpec] = {}
    with open(path, newline="") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            try:
                key = (int(r["n_head"]), int(r["n_kv_head"]), int(r["n_embd"]), int(r["n_expanded_embd"]),
                       int(r["vocab_size"]), int(r["num_tensor_parallel_workers"]))
                lin = sum(float(r[f"time_stats.{o}.median"]) for o in _GEMM_OPS) * 1e-3
                elt = sum(float(r[f"time_stats.{o}.median"]) for o in _ELEMENTWISE_OPS) * 1e-3
                tokens = int(r["num_tokens"])
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{i}: malformed Vidur profile row ({e})") from e
            if key not in models:
                nh, nkv, h, inter, vocab, tp = key
                hd = h // nh
                params = float(1 * (h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter) + 2 * vocab * h)
                models[key] = ModelSpec(name="profile", num_layers=1, hidden_size=h, num_heads=nh, num_kv_heads=nkv,
                                        head_dim=hd, intermediate_size=inter, vocab_size=vocab,
                                        total_params=params, active_params=params, tensor_parallel=tp)
            rows.append(ProfileRow(tokens, key[-1], lin, elt, models[key]))
    return rows


def _rel_err(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred - meas) / meas


def fit_linear(hw: HardwareSpec, rows: Sequence[ProfileRow]) -> HardwareSpec:
    """Fit compute/memory efficiency, roofline exponent, token tile and GEMM launch cost to
    profiled GEMM medians by grid search (minimising mean + max relative error)."""
    meas = np.array([r.linear_s for r in rows])
    t = np.array([r.num_tokens for r in rows], dtype=float)
    unit = [replace(hw, compute_efficiency=1.0, memory_efficiency=1.0, roofline_p=1.0, gemm_overhead_s=0.0)]
    # Ideal compute seconds per token and memory seconds, per row, from the model itself.
    flop_per_tok = np.array([2.0 * r.model.layer_params_active / r.model.tensor_parallel for r in rows])
    mem_s = np.array([float(linear_layer_time(replace(unit[0], peak_tflops=1e12), r.model, r.num_tokens))
                      for r in rows])  # compute ~0, memory term at 100 % efficiency
    peak = hw.peak_tflops * 1e12
    best: tuple[float, dict[str, float]] | None = None
    for tile in (1, 16, 32, 64, 128):
        tq = np.ceil(t / tile) * tile
        for p in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0):
            for ec in np.round(np.arange(0.5, 0.9801, 0.02), 2):
                C = tq * flop_per_tok / (peak * ec)
                for em in np.round(np.arange(0.5, 0.9801, 0.02), 2):
                    base = (C**p + (mem_s / em) ** p) ** (1.0 / p)
                    for k in np.arange(0.0, 12e-6, 0.5e-6):
                        e = np.abs(base + _GEMMS_PER_LAYER * k - meas) / meas
                        loss = float(e.mean() + e.max())
                        if best is None or loss < best[0]:
                            best = (loss, {"gemm_token_tile": tile, "roofline_p": p, "compute_efficiency": float(ec),
                                           "memory_efficiency": float(em), "gemm_overhead_s": float(k)})
    assert best is not None
    return replace(hw, **best[1])


def fit_elementwise(hw: HardwareSpec, rows: Sequence[ProfileRow]) -> HardwareSpec:
    """Least-squares (relative) fit of element-wise efficiency and the fixed per-layer cost."""
    meas = np.array([r.elementwise_s for r in rows])
    probe = replace(hw, elementwise_efficiency=1.0, per_layer_overhead_s=0.0)
    x = np.array([float(elementwise_layer_time(probe, r.model, r.num_tokens)) for r in rows])
    A = np.stack([x / meas, np.ones_like(x) / meas], axis=1)
    (inv_eff, fixed), *_ = np.linalg.lstsq(A, np.ones_like(meas), rcond=None)
    return replace(hw, elementwise_efficiency=float(min(1.0, 1.0 / inv_eff)), per_layer_overhead_s=float(max(0.0, fixed)))


def main() -> None:  # pragma: no cover - calibration helper
    """Print the fitted factors for the Vidur profiles (paste into conf/hardware/*.yaml)."""
    root = Path("/work/shared/data/profiles/vidur/compute")
    gpus = {"a100": HardwareSpec("a100_80gb", 312.0, 2.039, 80.0), "h100": HardwareSpec("h100", 989.0, 3.35, 80.0)}
    for gpu, hw in gpus.items():
        rows = [r for p in sorted(root.glob(f"{gpu}/meta-llama/*/mlp.csv")) for r in load_vidur_mlp(p)
                if r.num_tokens <= 4096]
        fit = fit_elementwise(fit_linear(hw, rows), rows)
        pred = np.array([float(linear_layer_time(fit, r.model, r.num_tokens)) for r in rows])
        e = _rel_err(pred, np.array([r.linear_s for r in rows]))
        print(gpu, {k: round(getattr(fit, k), 9) for k in ("compute_efficiency", "memory_efficiency", "roofline_p",
                                                           "gemm_token_tile",
                                                           "gemm_overhead_s", "elementwise_efficiency",
                                                           "per_layer_overhead_s")},
              f"linear rel err mean={e.mean():.3f} max={e.max():.3f} n={len(rows)}")


if __name__ == "__main__":  # pragma: no cover
    main()
