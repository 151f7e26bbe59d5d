"""How many requests/s a simulated deployment finishes when saturated with given requests.

Used to size a load per deployment: the evaluation runs a workload at the same share of every
deployment's capacity, and training's deployment randomisation (``env.deployments``) does the
same per episode. Saturated, not at the SLO: ``2 * max_num_seqs`` requests are kept waiting or
running, FIFO, the engine's own KV dtype, no shield.
"""

from __future__ import annotations

import math
from typing import Sequence

from batchpilot.core.engine import Engine, Request


class CapacityProbeError(RuntimeError):
    """The probe could not measure a rate (no requests, or an engine that makes no progress)."""


def saturated_rate(
    engine: Engine, requests: Sequence[Request], max_num_seqs: int, completions: int = 300,
    *, limit_s: float = 1e6,
) -> float:
    """Requests/s ``engine`` finishes with ``2 * max_num_seqs`` of ``requests`` (cycled) kept
    waiting or running, measured over ``completions`` finishes after as many again to fill it.
    The engine is used up (the caller closes it)."""
    if not requests:
        raise CapacityProbeError("no requests to probe the capacity with")
    engine.set_max_active(max_num_seqs)
    depth = 2 * max_num_seqs
    n_sent = n_done = 0
    t0 = math.nan

    def top_up(outstanding: int) -> int:
        nonlocal n_sent
        for _ in range(depth - outstanding):
            r = requests[n_sent % len(requests)]
            engine.add_request(Request(
                f"probe{n_sent}", engine.now, r.prompt_len, r.output_len,
                prefix_hashes=r.prefix_hashes, prefix_block_tokens=r.prefix_block_tokens,
            ))
            n_sent += 1
        return depth

    outstanding = top_up(0)
    while n_done < 2 * completions:
        res = engine.advance_until(engine.now + 1.0, stop_on_finish=True)
        done = len(res.finished)
        if done:
            if n_done < completions <= n_done + done:
                t0 = res.finished[completions - n_done - 1].finish_time
            n_done += done
            outstanding = top_up(outstanding - done)
        if engine.now > limit_s:  # engine seconds: a deployment this slow is broken, not saturated
            raise CapacityProbeError(f"the capacity probe made no progress in {limit_s:g} engine seconds")
    return completions / max(engine.now - t0, 1e-9)
