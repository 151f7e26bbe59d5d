"""vLLM as an operator deploys it without batchpilot: the environment of ``vllm_default`` and
``vllm_tuned``.

``VllmServerEnv`` is a ``ServingEnv`` with nothing of batchpilot between the clients and the
engine, by construction rather than by switching parts off afterwards:

- no shield: ``env.shielded: false``, so proposals pass as they are (``PassThroughShield``: no
  breaker, no shedding, no step or memory limit, no fail-safe), and the environment never
  predicts memory to refuse a request;
- no admission gate: every arrival reaches the engine at once, first come first served (the
  admission object only keeps the books of what is in flight); the engine's own waiting queue
  holds what cannot run, as ``vllm serve``'s does;
- the engine's own limits decide: ``max_num_seqs`` / ``max_num_active_seqs`` (the running
  batch), ``max_num_batched_tokens`` and, at arrival, the API server's
  ``max_num_queued_reqs`` / ``max_num_queued_tokens`` (``envs/api_server.py``; a refusal is a
  rejected request, a miss). They are ``engine.*`` settings of the episode's config.

The controller (a static one) sets the knobs it is given; its batch cap only reaches the
engine's ``set_max_active``, which never goes above the engine's own limit.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, open_dict

from batchpilot.core.knobs import Knobs
from batchpilot.envs.engines import EngineFactory
from batchpilot.envs.serving_env import EnginePlant, ServingEnv

#: The admission limits of a server with no gate in front: large enough never to bind.
UNGATED = 2**31 - 1


def server_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with admission reduced to book-keeping: no queue, wait, deadline, early-refusal, long-prompt,
    prefill-backlog or per-request memory limit, first come first served, and no shield."""
    c = copy.deepcopy(cfg)
    with open_dict(c):
        a = c.env.admission
        a.max_num_long = UNGATED
        a.max_queue_len = UNGATED
        a.max_wait_s = None
        a.ttft_deadline = False
        a.early_refusal = False  # vLLM refuses on its queue limits only (the engine's, not ours)
        a.on_time_first = False
        a.class_deadline_order = False  # nor across request classes
        a.newest_first_when_late = False
        a.prefill_backlog_budgets = None
        a.first_token_margin = False
        a.adapt_boundaries = False
        c.env.memory_admission = False
        c.env.shielded = False
        c.control.initial_bucketing = "fifo"
    return c


class _ServerPlant(EnginePlant):
    """The engine alone: the batch cap goes to the engine's running limit only, admission
    stays ungated, and there is nothing to shed."""

    def set_knobs(self, knobs: Knobs) -> None:
        env = self.env
        env.knobs = knobs
        env.admission.set_knobs(knobs.with_(batch_cap=UNGATED, bucketing="fifo"))
        env.engine.set_max_active(knobs.batch_cap)

    def shed(self, max_priority_kept: int) -> int:
        return 0


class VllmServerEnv(ServingEnv):
    """See the module docstring. ``cfg``: a composed config, as ``ServingEnv``'s; ``engine``:
    the server's own ``engine.*`` flags (``max_num_seqs``, ``max_num_queued_tokens``, ...),
    applied to the engine it runs and nowhere else: ``self.cfg`` stays the deployment every
    controller of an evaluation cell shares, so figures measured on it (the capacity bound) are
    the same for this server as for the others."""

    def __init__(
        self, cfg: DictConfig, *, engine: Mapping[str, Any] | None = None, render_mode: str | None = None
    ) -> None:
        base = server_config(cfg)
        super().__init__(cfg=base, render_mode=render_mode)
        #: The shared deployment's limits (``capacity_metrics`` measures on them).
        self._base_caps, self._base_max_num_seqs = self._caps, self._max_num_seqs
        self.server_flags = dict(engine or {})
        if self.server_flags:
            flagged = copy.deepcopy(base)
            with open_dict(flagged):
                for k, v in self.server_flags.items():
                    flagged.engine[k] = v
            self.engine.close()
            self._new_engine = EngineFactory(flagged)
            self._use_engine(self._new_engine())
            self._init_episode_state()

    def _init_episode_state(self) -> None:
        # The shield the base class builds is only kept for its memory predictions: what it
        # would say about its limits on this engine is noise here.
        shield_log = logging.getLogger("batchpilot.core.shield")
        level = shield_log.level
        shield_log.setLevel(logging.WARNING)
        try:
            super()._init_episode_state()
        finally:
            shield_log.setLevel(level)
        self._plant = _ServerPlant(self)
        self._plant.set_knobs(self.knobs)

    def capacity_metrics(self, window_s: float, goodput: float) -> dict[str, float]:
        """``ServingEnv.capacity_metrics`` on the shared deployment, not this server's flags:
        the bound is the cell's, whatever limits this server runs with."""
        own = self._caps, self._max_num_seqs
        self._caps, self._max_num_seqs = self._base_caps, self._base_max_num_seqs
        try:
            return super().capacity_metrics(window_s, goodput)  # type: ignore[misc]
        finally:
            self._caps, self._max_num_seqs = own
