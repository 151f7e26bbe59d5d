"""Trace windows as the JSONL that vLLM's own benchmark client replays with its timestamps
(``vllm.benchmarks.serve --dataset-name timed_trace``, vLLM 0.32's ``TimedTrace`` dataset).

One JSON object a line::

    {"timestamp": 0.731, "input_length": 374, "output_length": 44, "hash_ids": [7, 8]}

``timestamp`` is seconds from the window start (the client sleeps until then; pass
``--timed-trace-sec-multiplier 1``), ``input_length``/``output_length`` are token counts, and
``hash_ids`` name the prompt's blocks of ``chunk_tokens`` tokens: the client turns each id into
the same random token ids every time it meets it in one process, so equal ids are shared prompt
prefixes (prefix-cache hits), and it builds the prompt **only** from these blocks — a line needs
``ceil(input_length / chunk_tokens)`` ids or its prompt comes out short. Pass the chunk size
as ``--timed-trace-chunk-hash-size`` (``TimedTraceFile.chunk_tokens``).

Traces are read by ``batchpilot.envs.traces.read_trace`` (Azure, Mooncake, BurstGPT; window,
time scale, ``max_model_len``); here lengths are clipped further to what a small model should
see (prompts to ``max_prompt_len``, outputs to ``max_output_len``), Mooncake's prefix ids are
kept (trimmed to the clipped prompt) and a trace without ids gets fresh, unshared ones.
``hash_salt`` shifts every id, so two replays of one window share no prefix: a live evaluation
that replays the same window on several paths must not let the later ones hit the earlier
ones' prefix cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot.envs.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceArrays,
    TraceFormatError,
    TraceOptions,
    clip_lengths,
    read_trace,
)

#: Ids of one salt lie in ``[salt * HASH_STRIDE, (salt + 1) * HASH_STRIDE)``.
HASH_STRIDE = 10**9
#: The fields the client reads (its default labels).
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TimedTraceOptions:
    """How to cut a trace into a replay window for the client."""

    #: Window, speed and the engine's length limit (``batchpilot.envs.traces.TraceOptions``).
    trace: TraceOptions = field(default_factory=TraceOptions)
    #: Prompts longer than this are cut to it (``None`` = only ``trace.max_model_len``).
    max_prompt_len: int | None = None
    #: Outputs longer than this are cut to it (``None`` = only ``trace.max_model_len``).
    max_output_len: int | None = None
    #: At most this many requests, the first ones of the window (``None`` = all).
    max_requests: int | None = None
    #: Tokens per ``hash_ids`` block (the client's ``--timed-trace-chunk-hash-size``).
    chunk_tokens: int = MOONCAKE_BLOCK_TOKENS
    #: Set from ``trace.max_model_len`` by ``convert_trace`` (clip mode): prompt + output fit
    #: in it after the clips above (output cut first, as ``traces.clip_lengths``).
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_prompt_len", "max_output_len", "max_requests"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {v!r}")
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a whole number >= 1, got {self.chunk_tokens!r}")


@dataclass(frozen=True, slots=True)
class TimedTraceFile:
    """A window ready for the client: its records, where they came from, and the client
    arguments that read them as written."""

    records: tuple[dict[str, Any], ...]
    chunk_tokens: int
    source: str
    #: Requests whose prompt or output this module cut (on top of ``read_trace``'s clipping).
    clipped: int
    #: Window length on the replay clock, seconds.
    duration_s: float
    summary: str

    def __len__(self) -> int:
        return len(self.records)

    def client_args(self) -> list[str]:
        """``vllm bench serve`` arguments for this file's format (the path comes separately)."""
        return ["--dataset-name", "timed_trace", "--timed-trace-chunk-hash-size", str(self.chunk_tokens),
                "--timed-trace-sec-multiplier", "1"]

    @property
    def rate(self) -> float:
        """Mean arrival rate of the window, requests per second of the replay clock."""
        return len(self.records) / max(self.duration_s, 1e-9)

    def time_stretched(self, factor: float) -> "TimedTraceFile":
        """The same requests, every timestamp and the duration multiplied by ``factor``
        (< 1: replayed faster, more load); order, gaps' shape and lengths unchanged."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"time stretch must be a finite number > 0, got {factor!r}")
        records = tuple({**r, "timestamp": round(float(r["timestamp"]) * factor, 6)} for r in self.records)
        return replace(self, records=records, duration_s=self.duration_s * factor,
                       summary=f"{self.summary}; timestamps x{factor:.3g}")

    def salted(self, salt: int) -> list[dict[str, Any]]:
        """The records with every hash id moved into salt ``salt``'s range (no prefix shared
        with another salt's replay); timestamps and lengths unchanged."""
        if salt < 0:
            raise ValueError(f"salt must be >= 0, got {salt}")
        base = salt * HASH_STRIDE
        return [{**r, "hash_ids": [base + h for h in r["hash_ids"]]} for r in self.records]


def _blocks(n_tokens: int, chunk: int) -> int:
    return -(-int(n_tokens) // chunk)


def records_from_arrays(arrays: TraceArrays, options: TimedTraceOptions) -> tuple[list[dict[str, Any]], int]:
    """``TraceArrays`` as client records (see the module doc). Returns (records, clipped)."""
    o = options
    n = len(arrays) if o.max_requests is None else min(len(arrays), o.max_requests)
    t = np.asarray(arrays.arrival_s[:n], dtype=np.float64)
    p = np.asarray(arrays.prompt_len[:n], dtype=np.int64)
    out = np.asarray(arrays.output_len[:n], dtype=np.int64)
    p2 = p if o.max_prompt_len is None else np.minimum(p, o.max_prompt_len)
    o2 = out if o.max_output_len is None else np.minimum(out, o.max_output_len)
    if o.max_model_len is not None:
        p2, o2, _ = clip_lengths(p2, o2, o.max_model_len)
    clipped = int(((p2 != p) | (o2 != out)).sum())
    chunk = o.chunk_tokens
    # Trace ids are only meaningful at the trace's own block size; other sizes get fresh ids.
    hashes = arrays.prefix_hashes if chunk == arrays.prefix_block_tokens else None
    next_id = 0
    if hashes is not None:
        next_id = 1 + max((max(h) for h in hashes[:n] if h), default=-1)
    records = []
    for i in range(n):
        need = _blocks(p2[i], chunk)
        ids = list(hashes[i][:need]) if hashes is not None else []
        if len(ids) < need:  # no ids in the trace (or too few): fresh blocks, shared with nobody
            fresh = need - len(ids)
            ids += range(next_id, next_id + fresh)
            next_id += fresh
        records.append({"timestamp": round(float(t[i]), 6), "input_length": int(p2[i]),
                        "output_length": int(o2[i]), "hash_ids": ids})
    if next_id >= HASH_STRIDE:
        raise ValueError(f"hash ids reach {next_id}, past the salt stride {HASH_STRIDE}")
    return records, clipped


def convert_trace(path: str | Path, format: str, options: TimedTraceOptions | None = None) -> TimedTraceFile:
    """Read a trace window (``read_trace``: malformed input raises ``TraceFormatError`` naming
    the file and line) and shape it for the client."""
    o = options or TimedTraceOptions()
    topts = o.trace
    if topts.overflow == "clip" and topts.max_model_len is not None:
        # Cut to max_prompt_len / max_output_len first, the model length after (a 40k-token
        # prompt should keep its output and lose prompt, not be cut to 2047 + 1).
        o = replace(o, max_model_len=topts.max_model_len)
        topts = replace(topts, max_model_len=None)
    arrays = read_trace(path, format, topts)
    records, clipped = records_from_arrays(arrays, o)
    if not records:
        raise ValueError(f"{path}: the window holds no request ({arrays.report.summary()}){trace_span(path, format, topts)}")
    duration = float(arrays.duration_s)
    if o.max_requests is not None and len(records) < len(arrays):
        duration = float(records[-1]["timestamp"])
    summary = (f"{arrays.report.summary()}; {len(records)} requests replayed over {duration:.1f} s, "
               f"{clipped} more clipped to prompt <= {o.max_prompt_len}, output <= {o.max_output_len}")
    return TimedTraceFile(records=tuple(records), chunk_tokens=o.chunk_tokens, source=str(path), clipped=clipped,
                          duration_s=duration, summary=summary)


def trace_span(path: str | Path, format: str, trace: TraceOptions) -> str:
    """Where the trace's requests lie on the clock of ``start_s`` and ``duration_s`` (trace
    seconds after its first timestamp), said after an empty window so the user can pick a
    ``start_s`` inside it; '' when the whole trace holds no request either."""
    whole = read_trace(path, format, replace(trace, start_s=0.0, duration_s=None, time_scale=1.0,
                                             max_model_len=None))
    if not len(whole):
        return ""
    first, last = float(whole.arrival_s[0]), float(whole.arrival_s[-1])
    return (f"; the trace's requests arrive {first:.6g} s to {last:.6g} s after its first timestamp "
            f"(start_s={trace.start_s:g} and duration_s count from there)")


def write_timed_trace(records: list[dict[str, Any]] | tuple[dict[str, Any], ...], path: str | Path) -> Path:
    """Write records as JSONL (one object a line, fields in ``FIELDS`` order)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in FIELDS}, separators=(",", ":")) + "\n")
    return p


def read_timed_trace(path: str | Path, chunk_tokens: int) -> list[dict[str, Any]]:
    """Read and check a timed_trace JSONL: every line an object with the four fields,
    timestamps finite, >= 0 and non-decreasing, lengths whole numbers >= 1, enough
    ``hash_ids`` for the prompt. A problem raises ``TraceFormatError`` naming file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"timed_trace file not found: {p}")
    out: list[dict[str, Any]] = []
    last = -math.inf
    with p.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                raise TraceFormatError(p, line, "blank line (the client would fail on it)")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(p, line, f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(p, line, f"expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in FIELDS if k not in obj]
            if missing:
                raise TraceFormatError(p, line, f"missing field(s) {missing}; has {sorted(obj)}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise TraceFormatError(p, line, f"timestamp must be a finite number >= 0, got {ts!r}")
            if ts < last:
                raise TraceFormatError(p, line, f"timestamp {ts} is before the previous line's {last}")
            last = ts
            for k in ("input_length", "output_length"):
                v = obj[k]
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise TraceFormatError(p, line, f"{k} must be a whole number >= 1, got {v!r}")
            ids = obj["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise TraceFormatError(p, line, f"hash_ids must be a list of integers, got {ids!r}")
            if len(ids) < _blocks(obj["input_length"], chunk_tokens):
                raise TraceFormatError(p, line, f"{len(ids)} hash_ids cover fewer than input_length="
                                                f"{obj['input_length']} tokens at {chunk_tokens} tokens a block")
            out.append(obj)
    if not out:
        raise TraceFormatError(p, 1, "file is empty")
    return out
