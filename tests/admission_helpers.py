"""Helpers shared by the admission tests."""

from __future__ import annotations

from batchpilot.core.admission import Admission
from batchpilot.core.engine import Request


def warm_drain(a: Admission, n: int = 8) -> float:
    """``n`` drain samples (1000-token core prompts, first token 0.1 s after admission): 10k
    tokens/s measured. Returns the time after them."""
    t = 0.0
    for i in range(n):
        assert a.submit_or_admit(Request(f"w{i}", t, 1000, 10), t) == (None, True)
        a.on_first_token(f"w{i}", t + 0.1)
        a.on_finished(f"w{i}", 10)
        t += 1.1
    return t
