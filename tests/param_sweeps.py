"""Parameter sweeps whose full run belongs to ``make test`` and a few cases to ``make test-fast``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pytest


def sweep(cases: Sequence[Sequence[Any]], ids: Sequence[str], fast: Collection[str]) -> list[Any]:
    """``pytest.param`` per case; every case whose id is not in ``fast`` is marked ``slow``.
    A ``fast`` id that no case has is an error here, not a silently smaller fast run."""
    missing = set(fast) - set(ids)
    if missing:
        raise ValueError(f"fast cases {sorted(missing)} are not among the sweep's ids")
    return [pytest.param(*c, id=i, marks=() if i in fast else pytest.mark.slow) for c, i in zip(cases, ids)]
