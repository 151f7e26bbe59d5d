"""ServingEnv: the control loop of an LLM service as a Gymnasium environment.

## Description
Requests from a workload wait in Admission's length buckets in front of an engine (the vLLM
simulator by default, or a live in-process vLLM). Each step is one control interval of engine
time: the agent picks knobs (batch cap, bucketing mode, KV-cache dtype), the Shield clamps them
to the safety limits, then arrivals flow through admission into the engine while it iterates,
and Telemetry summarises the interval into the next observation.

## Action Space
``MultiDiscrete([5, 3, 3])`` (see ``batchpilot.core.actions``): batch cap, bucketing (fifo,
shortest_first, weighted), KV dtype (keep, 16-bit, 8-bit). With ``env.action_mode:
residual_pid`` (the default) the batch sub-action is a factor (x0.7, x0.85, x1, x1.15, x1.3) on
the cap the PID baseline sets this interval (``batchpilot.core.residual``); with ``absolute``
it steps the cap in force (-30 %, -15 %, 0, +15 %, +30 %). KV choices the engine cannot run are masked (``action_masks()``, and
``info["action_mask"]``); choosing one anyway is refused by the shield and reported in
``info["shield"]`` — never silently mapped to another dtype.

## Observation Space
``Box(0, 10, (25,), float32)``: the features of ``batchpilot.core.telemetry.FEATURES``
(table in ``docs/observation.md``), all computed from signals a production gateway also sees.

## Rewards
``0.6*throughput + 0.3*(1/latency) + 0.1*memory_efficiency`` (normalised) minus penalties for
SLO misses, preemptions, shield interventions, rejections, backlog and 8-bit KV's quality
cost. Weights in ``conf/env/default.yaml`` (``reward:``); parts in ``info["reward_terms"]``.

## Starting State
An empty engine at time 0 with ``control.initial_batch_cap``, ``control.initial_bucketing`` and
the engine's configured KV dtype; a fresh workload sampled from ``cfg.workload`` with the episode's seed
(``workload=randomized`` — the default — draws rate, burstiness, length mix and phase changes).
With ``env.deployments`` (training's ``train.deployments``) the episode's model/hardware is
drawn too, its load sized to that deployment's capacity (``envs/deployments.py``).

## Episode End
Truncated after ``episode_s`` engine seconds (``episode_s / control.interval_s`` steps). A KV-dtype
switch takes the engine down for the model's restart time: the intervals go on (arrivals queue,
nothing runs), so the switch's cost shows in the reward it costs. Terminated
only when the engine fails (``info["error"]`` says why; a one-off penalty applies).

## Arguments
``gymnasium.make("batchpilot/Serving-v0", engine="vllm", overrides=["model=llama3_70b"])``
or ``ServingEnv(cfg=composed_hydra_config)``.

## Version History
- v0: first release.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from batchpilot.config import load_config
from batchpilot.core.actions import ACTION_NVEC, action_mask, action_to_proposal
from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.control import FailSafe, PassThroughShield, guard
from batchpilot.core.engine import KV_DTYPES_8BIT, Engine, EngineError, RequestRejected, StepResult
from batchpilot.core.knobs import Knobs, Proposal
from batchpilot.core.plant import BreakerTrip, actuate
from batchpilot.core.residual import ACTION_MODES, ResidualPID, residual_pid_config
from batchpilot.core.shield import Shield, ShieldConfig
from batchpilot.core.telemetry import FEATURE_NAMES, OBS_HIGH, OBS_LOW, SLO, Snapshot, Telemetry
from batchpilot.envs.capacity import capacity_bound, saturated_rate, slo_rate
from batchpilot.envs.deployments import Deployment, DeploymentSet
from batchpilot.envs.engines import EngineFactory
from batchpilot.envs.reward import reward_terms
from batchpilot.envs.workloads import RequestStream, build_workload
from batchpilot.metrics import Offered, summarize
from batchpilot.nodes import from_node
from batchpilot.schemas.control import ControlLoopConfig, check_no_moved_keys
from batchpilot.schemas.env import RewardConfig
from batchpilot.schemas.serve import ControlConfig

#: ``env.memory_utilization`` draws only budgets where the shield admits this many requests of
#: its starting context: below it the deployment serves nothing (DeepSeek-V3 on an H200 at 0.7
#: holds 195k tokens of KV, but its weights alone are over the 80 % ceiling).
MIN_SERVABLE_BATCH = 8
#: ``ServingEnv._slo_capacity``'s figures in this process (a probe is deterministic on the
#: simulator; every controller of a workload and seed asks for the same one).
_SLO_CAPACITY: dict[tuple, float] = {}


def _shift_stream(stream: RequestStream, t0: float) -> RequestStream:
    """The same requests with arrival times moved by ``t0`` (the episode's start on the
    engine's clock), so arrivals are spread over the episode instead of all due at once."""
    return RequestStream(
        stream.arrival_s + t0, stream.prompt_len, stream.output_len, duration_s=stream.duration_s,
        priority=stream.priority, prefix_hashes=stream.prefix_hashes,
        prefix_block_tokens=stream.prefix_block_tokens, id_prefix=stream.id_prefix, info=stream.info,
        max_tokens=stream.max_tokens,
    )


class EnginePlant:
    """The environment's engine side as the plant a decision acts on (``batchpilot.core.plant``;
    the gateway's is a lane). A restart blocks: the engine is down for the model's restart time
    in engine time (the simulator) or really restarts (a live engine), and the intervals go on."""

    def __init__(self, env: "ServingEnv") -> None:
        self.env = env

    def capabilities(self):
        return self.env.engine.capabilities()

    def set_knobs(self, knobs: Knobs) -> None:
        env = self.env
        env.knobs = knobs
        env.admission.set_knobs(knobs)
        env.engine.set_max_active(knobs.batch_cap)

    def shed(self, max_priority_kept: int) -> int:
        env = self.env
        out = env.admission.shed(max_priority_kept, env.engine.now)
        for rej in out:
            env._on_rejected(rej)
        return len(out)

    def switch_kv_dtype(self, dtype: str) -> bool:
        self._restart(dtype)
        self.env._dtype_switches += 1
        self.env.telemetry.on_dtype_switch(self.env.engine.now)
        return True

    def restart(self, cause: str) -> bool:
        self._restart(None)
        self.env._breaker_restarts += 1
        return True

    def _restart(self, dtype: str | None) -> None:
        env = self.env
        env.engine.restart(dtype)  # charges (sim) or takes (live) the restart time
        # Capacity may change with the dtype: the shield predicts with the new layout.
        env.shield.update_memory_model(env.engine.memory_model())
        if env.admission.memory is not None:  # re-book what is in flight through the new layout
            env.admission.memory = env.shield


def slo_from_cfg(node: Any) -> SLO:
    """The ``slo`` node (checked against ``slo/schema`` at compose time) as an ``SLO``."""
    return from_node(SLO, node)


class ServingEnv(gym.Env):
    """See the module docstring: it is this environment's manual."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        cfg: DictConfig | None = None,
        *,
        engine: str | None = None,
        overrides: Sequence[str] = (),
        render_mode: str | None = None,
    ) -> None:
        if cfg is None:
            ov = list(overrides) + ([f"engine={engine}"] if engine else [])
            cfg = load_config(ov)
        elif engine is not None or overrides:
            raise ValueError("pass either cfg or engine/overrides, not both")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.cfg = cfg
        self.render_mode = render_mode
        e = cfg.env
        #: The control loop's interval, window, start knobs and observation scales: the
        #: ``control`` group, the gateway's too (``batchpilot/schemas/control.py``).
        check_no_moved_keys(cfg)  # env.interval_s & co. added with +key=...: read by nobody
        self.control = ControlLoopConfig.from_cfg(cfg.control)
        self.interval_s = self.control.interval_s
        if not float(e.episode_s) >= self.interval_s:
            raise ValueError(
                f"control.interval_s ({self.interval_s}) must be <= env.episode_s ({e.episode_s})"
            )
        self.max_steps = int(round(float(e.episode_s) / self.interval_s))
        self.slo = slo_from_cfg(cfg.slo)
        self.admission_cfg = AdmissionConfig.from_cfg(e.admission)
        #: The config's shield; with a drawn deployment, ``shield_cfg`` takes its model's restart.
        self.base_shield_cfg = self.shield_cfg = ShieldConfig.from_cfg(cfg.shield)
        #: ``env.shielded``: false = no shield (vLLM as shipped), built so rather than removed later.
        self.shielded = bool(e.get("shielded", True))
        #: The shield stage's rules for what a plant cannot see, as the gateway's (its
        #: ``serve.control`` defaults): the simulator's counters are never stale and its memory
        #: budget is always known, so they never bind here, but the step is the same code.
        self.fail_safe = FailSafe.from_cfg(ControlConfig()) if self.shielded else None
        self.kv16_dtype, self.kv8_dtype = str(e.kv16_dtype), str(e.kv8_dtype)
        self.action_mode = str(e.get("action_mode", "absolute"))
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"env.action_mode must be one of {ACTION_MODES}, got {self.action_mode!r}")

        self._new_engine = EngineFactory(cfg)
        #: ``env.deployments``: the model/hardware pairs an episode draws from (None = cfg's).
        self.deployments = DeploymentSet(cfg, self._new_engine) if e.get("deployments") else None
        self.deployment: Deployment | None = None
        #: ``env.memory_utilization``: this episode's engine node (None = ``cfg.engine``).
        self._engine_node: DictConfig | None = None
        self.observation_space = gym.spaces.Box(
            low=OBS_LOW, high=OBS_HIGH, shape=(len(FEATURE_NAMES),), dtype=np.float32
        )
        self.action_space = gym.spaces.MultiDiscrete(list(ACTION_NVEC))
        self._use_engine(self._new_engine())
        self._needs_fresh_engine = False
        self._init_episode_state()

    # --- Gymnasium API ---------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        # workload.seed_offset: the same episode seeds draw other episodes of this workload.
        offset = int(self.cfg.workload.get("seed_offset", 0) or 0)
        super().reset(seed=None if seed is None else seed + offset)
        drawn = self.deployments.draw(self.np_random) if self.deployments is not None else None
        engine_node = self._draw_engine_node(drawn)
        if drawn is not self.deployment or engine_node is not None:
            self.engine.close()
            self.deployment, self._engine_node = drawn, engine_node
            self._use_engine(self._new_engine(*self._nodes(), engine=engine_node))
        elif self._needs_fresh_engine or self.engine.kv_dtype != self._initial_kv_dtype():
            self.engine.close()
            self.engine = self._new_engine(*self._nodes(), engine=self._engine_node)
        else:
            self._drain_engine()
        self._needs_fresh_engine = self.cfg.engine.kind == "sim"
        self._init_episode_state()
        workload = self.cfg.workload if self.deployment is None else self.deployment.workload
        if self.cfg.env.get("load_vs_capacity") is not None:
            workload = self._sized_to_capacity(workload, self.cfg.env.load_vs_capacity)
        self.stream = build_workload(workload, self.np_random, self._caps.max_model_len)
        if self._episode_start > 0:  # a live engine's clock does not restart at 0
            self.stream = _shift_stream(self.stream, self._episode_start)
        self._replaced_arrivals: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        snap = self._snapshot()
        obs = self.telemetry.observation(snap)
        return obs, self._info(snap, {}, None)

    def step(self, action):
        kv = {"kv16_dtype": self.kv16_dtype, "kv8_dtype": self.kv8_dtype}
        if self.residual is not None:
            proposal = self.residual.propose(action, self._last_snapshot, self.knobs, **kv)
        else:
            proposal = action_to_proposal(action, self.knobs, **kv)
        return self.step_proposal(proposal)

    def step_proposal(self, proposal: Proposal):
        """One control interval with a controller's proposal (PID, AIMD, static use this;
        ``step`` translates a policy action into a proposal first)."""
        decision = guard(proposal, self._last_snapshot, self.knobs, self.shield, self.engine.now,
                         fail_safe=self.fail_safe).decision
        if decision.interventions:
            self.telemetry.on_shield_intervention(len(decision.interventions))
        error = None
        try:
            actuate(decision, self.knobs, self._plant, self._trip, restart_on_trip=self.shield_cfg.breaker_restart)
            t_end = self._interval_start + self.interval_s
            self._run_until(t_end, stop_when_served=self._steps >= self.max_steps)
        except EngineError as exc:  # expected backend failure: end the episode, keep training
            error = f"{type(exc).__name__}: {exc}"
        self._steps += 1
        # An engine that was down past the interval (a blocking restart) resumes the clock here.
        self._interval_start = max(self._interval_start + self.interval_s, self.engine.now)
        truncated = self._steps >= self.max_steps and error is None
        if truncated and self.cfg.env.drain_on_truncate:
            deadline = self._episode_start + self.max_steps * self.interval_s + float(self.cfg.env.drain_timeout_s)
            if self.cfg.env.drain_controlled and self._requests_left() and self.engine.now < deadline:
                truncated = False  # the controller keeps acting until every request is served, as the gateway's loop
            else:
                self._drain_all(deadline if self.cfg.env.drain_controlled else None)
        snap = self._snapshot()
        on_8bit = float(self.knobs.kv_dtype in KV_DTYPES_8BIT)
        terms = reward_terms(snap, self.slo, self.reward_cfg, rate_scale=self.rate_scale, on_8bit_frac=on_8bit)
        if error is not None:
            terms["engine_failure"] = -self.reward_cfg.engine_failure
        rew = float(sum(terms.values()))
        obs = self.telemetry.observation(snap)
        self._last_snapshot = snap
        info = self._info(snap, decision.interventions, decision)
        info["reward_terms"] = terms
        if error is not None:
            info["error"] = error
            self._needs_fresh_engine = True
        if truncated or error is not None:
            info["episode_metrics"] = self.episode_metrics()
        return obs, rew, error is not None, truncated, info

    def action_masks(self) -> np.ndarray:
        """Flat mask for sb3-contrib's MaskablePPO: KV dtypes the engine cannot run are off."""
        return self._mask.copy()

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        s = self._last_snapshot
        return (
            f"t={s.time:8.1f}s cap={self.knobs.batch_cap:4d} {self.knobs.bucketing:14s} "
            f"kv={self.knobs.kv_dtype:8s} run={s.num_running:4d} q={s.queue_total:5d} "
            f"kv_use={s.kv_cache_usage:5.2f} goodput={s.request_goodput:6.2f}/s "
            f"p99_ttft={s.ttft_p99_ms:8.1f}ms"
        )

    def close(self) -> None:
        self.engine.close()

    # --- what evaluation reads -------------------------------------------------------------
    @property
    def stream(self) -> RequestStream:
        """Where the episode's requests come from. A stream set in mid-episode (the lookahead's
        copies replay a forecast) keeps the requests the old one had already offered, so
        attainment stays over every request that arrived."""
        return self._stream

    @stream.setter
    def stream(self, stream: RequestStream) -> None:
        old = getattr(self, "_stream", None)
        if old is not None and old is not stream and hasattr(self, "_replaced_arrivals"):
            self._replaced_arrivals.append(self._arrived(old))
        self._stream = stream

    @staticmethod
    def _arrived(stream: RequestStream) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt lengths, output lengths, priorities) of the requests that arrived so far."""
        n = len(stream) - stream.num_remaining
        return np.asarray(stream.prompt_len[:n]), np.asarray(stream.output_len[:n]), np.asarray(stream.priority[:n])

    @property
    def snapshot(self) -> Snapshot:
        """The last interval's telemetry (the input of PID/AIMD/static controllers)."""
        return self._last_snapshot

    def episode_metrics(self) -> dict[str, float]:
        """``vllm bench serve``-style aggregates over the episode so far, read as a user reads
        them (``batchpilot.metrics``): goodput over the arrival window (the episode's
        ``episode_s``, or less when it ended early; the drain after it is outside the
        denominator), SLO attainment over every request that arrived, the refusal rate, and in
        an evaluation episode on the simulator (``drain_on_truncate``) the capacity bound
        (``capacity_metrics``)."""
        now = self.engine.now
        duration = max(now - self._episode_start, 1e-9)
        window = max(min(duration, self.max_steps * self.interval_s), 1e-9)
        n_admitted = self.admission.num_admitted
        prompts, outputs, priorities = zip(*self._replaced_arrivals, self._arrived(self.stream))
        offered: Offered | None = Offered(np.concatenate(prompts), np.concatenate(outputs), np.concatenate(priorities))
        if offered is not None and len(offered) < len(self._finished) + len(self._rejections):
            # Requests queued into admission directly, not from the workload (a caller driving
            # the plant by hand): the stream does not know them, so offered = completed + rejected.
            offered = None
        m = summarize(self._finished, duration, self.slo, num_rejected=len(self._rejections), window_s=window,
                      offered=offered, bucket_edges=self.admission_cfg.boundaries)
        m.update(self.capacity_metrics(window, m["request_goodput"]))
        m.update(
            peak_kv_usage=self._peak_kv,
            preemptions=float(self._preemptions),
            shield_interventions=float(self.shield_interventions),
            dtype_switches=float(self._dtype_switches),
            breaker_restarts=float(self._breaker_restarts),
            # The engine's iterations and their mean tokens (prefill + decode), as vLLM's
            # vllm:iteration_tokens_total counts them: what a live run's engine is compared on.
            engine_iterations=float(self._iterations),
            mean_iteration_tokens=self._iteration_tokens / self._iterations if self._iterations else math.nan,
            mean_admission_wait_ms=1e3 * self._admission_wait_s / n_admitted if n_admitted else math.nan,
            mean_engine_ttft_ms=1e3 * self._engine_ttft_s / self._num_engine_ttft if self._num_engine_ttft else math.nan,
        )
        return m

    def capacity_metrics(self, window_s: float, goodput: float) -> dict[str, float]:
        """The capacity bound (docs/evaluation.md, "Metrics"). ``slo_capacity``: the most SLO-met
        requests/s the simulated engine finishes of this episode's requests, in arrival order, at
        a fixed concurrency (``envs.capacity.slo_rate``); ``capacity_bound``: Σ over the arrival
        window's control intervals of min(arrivals, capacity at the SLO × interval), per second
        of window, with that capacity measured per prompt-length octave (each octave's own
        requests) and the engine's time going to the octave it serves fastest first
        (``capacity_bound`` with classes: a controller may serve cheap prompts first);
        ``share_of_bound``: ``goodput`` / ``capacity_bound``. Each rate is the better of the
        deployment's runnable 16- and 8-bit KV dtypes, so every controller of a cell gets the
        same figures. NaN outside an evaluation episode on the simulator (a live engine would
        take real time to probe; training does not need them)."""
        nan = {"slo_capacity": math.nan, "capacity_bound": math.nan, "share_of_bound": math.nan}
        if not (self.cfg.env.drain_on_truncate and self.cfg.engine.kind == "sim" and len(self.stream)):
            return nan
        stream = copy.copy(self.stream)  # its own cursor over the same (read-only) arrays
        stream.reset()
        requests = stream.pop_until(math.inf)
        # Classes: prompt-length octaves ([2^k, 2^(k+1)) tokens). Admission's three buckets were
        # too coarse: controllers that favour short prompts within a bucket (shortest first,
        # vLLM's queued-token limit) beat a bound over them by up to 8 % on bursty.
        octave = np.floor(np.log2(np.asarray(self.stream.prompt_len, np.float64))).astype(np.int64)
        classes = octave - int(octave.min())
        mix = self._slo_capacity(requests)
        per_class = [self._slo_capacity([r for r, c in zip(requests, classes) if c == i])
                     for i in range(int(classes.max()) + 1)]
        arrivals = np.asarray(self.stream.arrival_s) - self._episode_start
        bound = capacity_bound(arrivals, window_s, self.interval_s, per_class, classes) / window_s
        return {"slo_capacity": mix, "capacity_bound": bound,
                "share_of_bound": goodput / bound if bound > 0 else math.nan}

    def _slo_capacity(self, requests: list) -> float:
        """``slo_rate`` of ``requests`` (0 for none), once per (deployment, requests, SLO) in a
        process: the cells of one workload and seed share it."""
        if not requests:
            return 0.0
        base = self._engine_node if self._engine_node is not None else self.cfg.engine
        model, hardware = self._nodes()
        dtypes = [d for d in dict.fromkeys((self.kv16_dtype, self.kv8_dtype)) if self._caps.can_run(d)]
        nodes = (base, self.cfg.model if model is None else model, self.cfg.hardware if hardware is None else hardware)
        key = (repr([OmegaConf.to_container(n, resolve=True) for n in nodes]), repr(self.slo), self._max_num_seqs,
               tuple(dtypes), hash(tuple((r.prompt_len, r.output_len, r.prefix_hashes) for r in requests)))
        if key not in _SLO_CAPACITY:
            rates = []
            for d in dtypes or [str(base.get("kv_dtype", "auto"))]:
                node = copy.deepcopy(base)
                with open_dict(node):
                    node.kv_dtype = d
                rates.append(slo_rate(lambda n=node: self._new_engine(model, hardware, engine=n), requests,
                                      self._max_num_seqs, self.slo)[0])
            _SLO_CAPACITY[key] = max(rates)
        return _SLO_CAPACITY[key]

    @property
    def finished_requests(self):
        return list(self._finished)

    # --- internals -----------------------------------------------------------------------
    def _use_engine(self, engine: Engine) -> None:
        """What depends on the deployment: its limits, runnable KV dtypes, the PID a residual
        action scales, the reward's scales (a drawn deployment's load multiplier)."""
        self.engine = engine
        caps = self._caps = engine.capabilities()
        self._max_num_seqs = caps.max_num_seqs
        model = self.cfg.model if self.deployment is None else self.deployment.model
        self.reward_cfg = RewardConfig.from_cfg(self.cfg.env.reward, float(model.get("kv8_quality_cost", 0.0)))
        mult = 1.0 if self.deployment is None else self.deployment.load_multiplier
        # The restart a KV switch costs is the drawn model's, as the engine charges it: the
        # shield's gain gate and the KV agent's observation must see 600 s on DeepSeek-V3, not
        # the config's own model's 40 s.
        self.shield_cfg = self.base_shield_cfg if self.deployment is None else dataclasses.replace(
            self.base_shield_cfg, dtype_restart_s=float(self.deployment.model.restart_base_s))
        #: The reward's throughput scale: the configured one times the deployment's capacity.
        self.rate_scale = self.control.rate_scale * mult
        #: ``action_mode: residual_pid``: the PID whose cap an action's factor multiplies.
        self.residual: ResidualPID | None = None
        if self.action_mode == "residual_pid":
            self.residual = ResidualPID(residual_pid_config(self.slo, self._max_num_seqs))
        self._mask = action_mask(
            {d: caps.can_run(d) for d in (self.kv16_dtype, self.kv8_dtype)},
            kv16_dtype=self.kv16_dtype,
            kv8_dtype=self.kv8_dtype,
        )
        #: Why a masked KV choice is masked (shown to users; never silently remapped).
        self.unavailable = {
            d: caps.why_not(d) for d in (self.kv16_dtype, self.kv8_dtype) if not caps.can_run(d)
        }

    def _draw_engine_node(self, drawn: Deployment | None) -> DictConfig | None:
        """``env.memory_utilization``: the engine node with a drawn ``gpu_memory_utilization``
        (a grid of 0.05), so the KV budget varies as it does between deployments that share a GPU
        or hold other buffers; None when unset. A value the model does not fit at (weights and
        activations over the budget, or no room for ``MIN_SERVABLE_BATCH`` requests under the
        shield's memory ceiling, which counts the weights) moves up the grid to the first that does."""
        bounds = self.cfg.env.get("memory_utilization")
        if bounds is None:
            return None
        lo, hi = (float(b) for b in bounds)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"env.memory_utilization must be [low, high] with 0 < low <= high <= 1, got {list(bounds)}")
        if self.cfg.engine.kind != "sim":
            raise ValueError("env.memory_utilization needs the simulator (engine=sim): a live engine has its own")
        steps = np.arange(math.ceil(lo / 0.05 - 1e-9), math.floor(hi / 0.05 + 1e-9) + 1) * 0.05
        if not len(steps):
            raise ValueError(f"env.memory_utilization {list(bounds)} holds no multiple of 0.05")
        nodes = (None, None) if drawn is None else (drawn.model, drawn.hardware)
        why = ""
        for value in steps[int(self.np_random.integers(len(steps))):]:
            node = copy.deepcopy(self.cfg.engine)
            with open_dict(node):
                node.gpu_memory_utilization = round(float(value), 4)
            try:
                engine = self._new_engine(*nodes, engine=node)
            except ValueError as exc:  # the model does not fit at this budget
                why = str(exc)
                continue
            try:
                shield = Shield(self.base_shield_cfg, engine.memory_model(), engine.capabilities(), slo=self.slo)
                room = shield.max_feasible_batch(engine.kv_dtype)
            finally:
                engine.close()
            if room >= MIN_SERVABLE_BATCH:
                return node
            why = f"gpu_memory_utilization {value:.2f} leaves the shield room for {room} requests"
        raise ValueError(f"env.memory_utilization {list(bounds)}: no value serves {MIN_SERVABLE_BATCH} requests: {why}")

    def _sized_to_capacity(self, workload: Any, bounds: Sequence[float]) -> Any:
        """``env.load_vs_capacity``: ``workload`` with its rate scaled so the episode's mean
        load is a drawn share of what this engine finishes of the episode's own requests.

        The share is drawn first; the stream is then drawn once to probe, and again from the
        same generator state with the new scale (same lengths and shape, the load moved)."""
        lo, hi = (float(b) for b in bounds)
        if not 0 < lo <= hi:
            raise ValueError(f"env.load_vs_capacity must be [low, high] with 0 < low <= high, got {list(bounds)}")
        share = float(np.exp(self.np_random.uniform(np.log(lo), np.log(hi))))
        state = copy.deepcopy(self.np_random.bit_generator.state)
        probe = build_workload(workload, self.np_random, self._caps.max_model_len)
        self.np_random.bit_generator.state = state
        requests = probe.pop_until(math.inf)
        if not requests:
            return workload
        engine = self._new_engine(*self._nodes(), engine=self._engine_node)
        try:
            capacity = saturated_rate(engine, requests, self._max_num_seqs)
        finally:
            engine.close()
        mean_rate = len(requests) / max(float(probe.duration_s), self.interval_s)
        sized = copy.deepcopy(workload)
        with open_dict(sized):
            sized.rate_scale = float(sized.get("rate_scale", 1.0)) * share * capacity / mean_rate
        return sized

    def _nodes(self) -> tuple[Any, Any]:
        d = self.deployment
        return (None, None) if d is None else (d.model, d.hardware)

    def _initial_kv_dtype(self) -> str:
        return str(self.cfg.engine.get("kv_dtype", "auto"))

    def _init_episode_state(self) -> None:
        e, ctl = self.cfg.env, self.control
        cap = min(ctl.initial_batch_cap, self._max_num_seqs)
        self.knobs = Knobs(batch_cap=cap, bucketing=ctl.initial_bucketing, kv_dtype=self.engine.kv_dtype)
        self.admission = Admission(self.admission_cfg, self.knobs)
        self.admission.use_slo(self.slo)  # each priority class by its own TTFT objective
        self.admission.use_token_budget(self._caps.max_num_batched_tokens)
        self.shield = Shield(self.shield_cfg, self.engine.memory_model(), self._caps, slo=self.slo, now=self.engine.now)
        if e.get("start_dtype_dwell", False):  # the start dtype was a choice: the dwell runs from it
            self.shield.last_dtype_switch = self.engine.now
        if not self.shielded:  # kept for its memory predictions only
            self.shield = PassThroughShield(self.shield)  # type: ignore[assignment]
        if self.cfg.env.get("memory_admission", True):  # per request: in flight + it within the ceiling
            why = self.shield.no_room_reason()
            if why is not None:
                model, hardware = self._nodes() if self.deployment is not None else (self.cfg.model, self.cfg.hardware)
                raise ValueError(f"{model.get('name', '?')} on {hardware.get('name', '?')}: {why}")
            self.admission.memory = self.shield
        self.telemetry = Telemetry(
            slo=self.slo,
            num_buckets=self.admission_cfg.num_buckets,
            window_s=ctl.window_s,
            max_num_seqs=self._max_num_seqs,
            max_model_len=self._caps.max_model_len,
            # The observation's scales are the configured ones whatever the deployment: a served
            # policy knows no capacity, only what it was trained with (the manifest's).
            rate_scale=ctl.rate_scale,
            token_rate_scale=ctl.token_rate_scale,
        )
        now = self.engine.now
        self.telemetry.reset(now)
        self.engine.set_max_active(self.knobs.batch_cap)
        self._episode_start = self._interval_start = now
        self._steps = 0
        self._finished: list = []
        self._rejections: list = []
        self._preemptions = 0
        self._iterations = 0
        self._iteration_tokens = 0
        #: Where a request's TTFT goes: waiting in admission, then in the engine (as a live run's
        #: gateway and vLLM report them).
        self._admission_wait_s = 0.0
        self._engine_ttft_s = 0.0
        self._num_engine_ttft = 0
        self._dtype_switches = 0
        self._breaker_restarts = 0
        self._plant = EnginePlant(self)
        self._trip = BreakerTrip()
        self._peak_kv = 0.0
        self.shield_interventions = 0
        self._last_snapshot = self._snapshot_peek()
        if self.residual is not None:
            self.residual.reset(self.knobs)

    def _run_until(self, t_end: float, stop_when_served: bool = False) -> None:
        """Arrivals → admission → engine, until the engine clock reaches ``t_end`` (or, with
        ``stop_when_served``, the last request of the stream finishes: a controlled drain's
        clock ends where the client's last answer arrives)."""
        eng, adm, stream = self.engine, self.admission, self.stream
        while True:
            self._take_arrivals(eng.now)
            if eng.now >= t_end or (stop_when_served and not self._requests_left()):
                break
            t_next = min(stream.next_arrival_time, t_end)
            if t_next <= eng.now:
                continue
            # While requests wait, come back when a slot frees or a prompt leaves the engine's
            # prefill backlog (either may let one in).
            waiting = adm.num_waiting > 0
            res = eng.advance_until(t_next, waiting or stop_when_served, waiting)  # (stop_on_finish, stop_on_first_token)
            self._account(res)

    def _requests_left(self) -> bool:
        """Whether a request of the episode is not yet finished or rejected (waiting, in flight,
        or still to arrive)."""
        adm = self.admission
        return bool(adm.num_waiting or adm.num_in_flight or self.stream.next_arrival_time < math.inf)

    def _take_arrivals(self, now: float) -> None:
        adm = self.admission
        stream = self.stream
        if stream.next_arrival_time <= now:
            arrivals = stream.pop_until(now)
            on_arrival = self.telemetry.on_arrival
            if len(arrivals) == 1:  # alone: admission may take it at once (the same as submit, then admit)
                req = arrivals[0]
                on_arrival(req.arrival_time, req.prompt_len)
                rej, admitted = adm.submit_or_admit(req, now)
                if rej is not None:
                    self._on_rejected(rej)
                if admitted:
                    self._to_engine(req, now)
            else:
                for req in arrivals:
                    on_arrival(req.arrival_time, req.prompt_len)
                    rej = adm.submit(req, now)
                    if rej is not None:
                        self._on_rejected(rej)
        if adm.expires:
            for rej in adm.expire(now):
                self._on_rejected(rej)
        if adm.num_waiting:  # (below saturation mostly none: an arrival alone is taken at once)
            for req in adm.admit(now):
                self._to_engine(req, now)
            for rej in adm.take_rejections():  # no longer fits even alone (the memory model moved)
                self._on_rejected(rej)

    def _to_engine(self, req: Any, now: float) -> None:
        """Hand a request admission let in at ``now`` to the engine."""
        self._admission_wait_s += now - req.arrival_time
        try:
            self.engine.add_request(req)
        except RequestRejected as exc:
            self.admission.on_finished(req.request_id)
            self._on_rejected(exc)

    def _account(self, res: StepResult) -> None:
        tel, adm = self.telemetry, self.admission
        if res.first_tokens:
            for rid, arrival, first in res.first_tokens:
                tel.on_first_token(rid, first, first - arrival)
                since_admission = adm.on_first_token(rid, first)
                if since_admission is not None:
                    self._engine_ttft_s += since_admission
                    self._num_engine_ttft += 1
        tel.on_output_tokens(res.num_output_tokens)
        self._iterations += res.num_iterations
        self._iteration_tokens += res.num_prefill_tokens + res.num_decode_tokens
        if res.finished:
            finished = self._finished
            for fr in res.finished:
                tel.on_finished(fr.request_id, fr.finish_time, fr.ttft, fr.tpot, fr.e2el, fr.priority)
                # What it generated, now that it finished (the gateway reads the answer's usage):
                # the output estimate of admission's memory charge learns from it.
                adm.on_finished(fr.request_id, fr.output_len)
                finished.append(fr)
        if res.preempted:
            tel.on_preemptions(len(res.preempted))
            self._preemptions += len(res.preempted)

    def _on_rejected(self, rej: Any) -> None:
        self._rejections.append(rej)
        self.telemetry.on_rejected()

    def _drain_engine(self) -> None:
        """Between episodes on a persistent (live) engine: let leftovers finish unrecorded,
        then start from a cold prefix cache, as the simulator's fresh engine does."""
        eng = self.engine
        for _ in range(1_000_000):
            st = eng.stats()
            if st.num_running + st.num_waiting == 0:
                eng.reset_prefix_cache()
                return
            eng.step()
        raise EngineError("engine did not drain between episodes")

    def _drain_all(self, deadline: float | None = None) -> None:
        """At the end of an evaluation episode: every request admitted or queued finishes, or
        is counted as rejected (``unfinished``) after ``drain_timeout_s`` (or at ``deadline``)."""
        if deadline is None:
            deadline = self.engine.now + float(self.cfg.env.drain_timeout_s)
        adm, eng = self.admission, self.engine
        while (adm.num_waiting or adm.num_in_flight) and eng.now < deadline:
            self._take_arrivals(eng.now)
            before = eng.now
            res = eng.advance_until(min(eng.now + self.interval_s, deadline), stop_on_finish=True,
                                    stop_on_first_token=adm.num_waiting > 0)
            self._account(res)
            if eng.now == before and res.num_iterations == 0:
                break
        left = adm.num_waiting + adm.num_in_flight
        for _ in range(left):
            self._on_rejected("unfinished")

    def _snapshot_peek(self) -> Snapshot:
        st = self.engine.stats()
        return Snapshot(
            time=st.time, interval_s=self.interval_s, arrival_rate=0.0, mean_prompt_len=0.0,
            queue_depth=self.admission.queue_depths, num_running=st.num_running,
            num_waiting_engine=st.num_waiting, kv_cache_usage=st.kv_cache_usage,
            request_throughput=0.0, output_throughput=0.0, request_goodput=0.0,
            ttft_p50_ms=0.0, ttft_p99_ms=0.0, tpot_p50_ms=0.0, tpot_p99_ms=0.0,
            e2el_p50_ms=0.0, e2el_p99_ms=0.0, slo_attainment=1.0, preemptions=0, rejected=0,
            shield_interventions=0, knobs=self.knobs, time_since_dtype_switch_s=math.inf,
        )

    def _snapshot(self) -> Snapshot:
        st = self.engine.stats()
        self._peak_kv = max(self._peak_kv, st.kv_cache_usage)
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        snap = self.telemetry.snapshot(
            self.engine.now,
            queue_depth=self.admission.queue_depths,
            num_running=st.num_running,
            num_waiting_engine=st.num_waiting,
            kv_cache_usage=st.kv_cache_usage,
            knobs=self.knobs,
            prefix_cache_hit_rate=hit,
            num_late_waiting=self.admission.num_late_waiting,
        )
        self.shield_interventions += snap.shield_interventions
        self._last_snapshot = snap
        return snap

    def _info(self, snap: Snapshot, interventions: dict, decision: Any) -> dict[str, Any]:
        pred = decision.predicted_memory_fraction if decision is not None else self.shield.predict_fraction(self.knobs)
        return {
            "knobs": self.knobs.as_dict(),
            "predicted_memory_fraction": float(pred),
            "shield": dict(interventions),
            "action_mask": self._mask.copy(),
            "kv_unavailable": dict(self.unavailable),
            "metrics": {
                "time": snap.time,
                "arrival_rate": snap.arrival_rate,
                "queue_depth": snap.queue_total,
                "num_running": snap.num_running,
                "kv_cache_usage": snap.kv_cache_usage,
                "request_throughput": snap.request_throughput,
                "output_throughput": snap.output_throughput,
                "request_goodput": snap.request_goodput,
                "p99_ttft_ms": snap.ttft_p99_ms,
                "p99_tpot_ms": snap.tpot_p99_ms,
                "slo_attainment": snap.slo_attainment,
                "preemptions": snap.preemptions,
            },
        }
