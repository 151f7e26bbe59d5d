"""What admission charges for a request's output, without knowing it (issue 53, part 3).

Admission's memory check needs, per request, how many output tokens it will hold in the KV
cache at its end. Nobody in front of the engine knows that: the gateway sees the prompt and the
client's ``max_tokens``. Charging ``max_tokens`` is safe but very conservative (a chat client
that sends no cap is charged the whole context, ~128k tokens on some models), while vLLM itself
reserves nothing: it allocates KV blocks as tokens come and preempts (recomputes) a request when
they run short. So an under-estimate costs preemptions, not failures.

``OutputEstimate`` charges ``min(max_tokens, a high quantile of the output lengths of requests
that have already finished)``: the gateway learns those from each finished answer
(``usage.completion_tokens``, or the streamed chunks), the simulator from its finished
requests. It holds a sliding window of the last ``window`` completions and, until
``min_samples`` have been seen, charges the prior (``prior_tokens``; None: the cap itself, the
strict charge). One implementation, used by ``Admission`` for the env and the gateway alike; it
is told lengths (``observe``) and never reads a request.

Survivorship: the window sees short answers before long ones (they finish first), so right after
a change to longer outputs the quantile lags; a high quantile and the prior keep it on the
conservative side, and what it misses shows as engine preemptions.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque

#: How admission charges a request's output: ``max_tokens`` (the client's cap, or the model's
#: room when it sent none) or ``estimate`` (the cap, at most the recent completions' quantile).
CHARGE_MODES: tuple[str, ...] = ("max_tokens", "estimate")


class OutputEstimate:
    """A high quantile of recent completions' output lengths, as an upper bound on what a new
    request is charged. See the module docstring."""

    __slots__ = ("quantile", "window", "min_samples", "prior_tokens", "_recent", "_sorted", "_value", "num_observed")

    def __init__(self, quantile: float = 0.95, window: int = 500, min_samples: int = 32,
                 prior_tokens: int | None = None) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"output estimate quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"output estimate window must be >= 1 completion, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"output estimate min_samples must be in [1, window={window}], got {min_samples}")
        if prior_tokens is not None and prior_tokens < 0:
            raise ValueError(f"output estimate prior_tokens must be >= 0 or null, got {prior_tokens}")
        self.quantile, self.window, self.min_samples = float(quantile), int(window), int(min_samples)
        self.prior_tokens = None if prior_tokens is None else int(prior_tokens)
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        self._value: int | None = None  # the quantile once min_samples are in, else None
        #: Completions observed since construction (the window keeps the last ``window``).
        self.num_observed = 0

    def observe(self, output_tokens: int) -> None:
        """A request finished having generated ``output_tokens`` (what its answer reported).
        O(window) at worst (a list insert), a memmove in practice."""
        n = int(output_tokens)
        if n < 0:
            raise ValueError(f"a finished request cannot have generated {n} tokens")
        self.num_observed += 1
        self._recent.append(n)
        insort(self._sorted, n)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect_left(self._sorted, old)]
        k = len(self._sorted)
        if k >= self.min_samples:
            # The higher order statistic (no interpolation down): the smallest value with at
            # least ``quantile`` of the window at or below it.
            self._value = self._sorted[max(0, math.ceil(self.quantile * k) - 1)]

    @property
    def value(self) -> int | None:
        """The current quantile, None while fewer than ``min_samples`` completions were seen."""
        return self._value

    @property
    def num_samples(self) -> int:
        """Completions in the window now."""
        return len(self._recent)

    def charge(self, max_tokens: int | None) -> int:
        """Output tokens to charge a request whose cap is ``max_tokens`` (None: unknown). Never
        above the cap; the prior (or the cap) until ``min_samples`` completions were seen."""
        est = self._value if self._value is not None else self.prior_tokens
        if max_tokens is None:
            return 0 if est is None else est
        cap = max(int(max_tokens), 0)
        return cap if est is None or est >= cap else est
