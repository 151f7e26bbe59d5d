"""Readers for real LLM-serving request traces, so the environment can replay them.

Three formats are read into one shape (``TraceArrays``: a struct of numpy arrays plus a
``TraceReport`` of what was read, clipped and skipped):

- ``azure``: Azure LLM inference traces, CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with
  wall-clock timestamps (``2023-11-16 18:15:46.6805900``; read as UTC when no zone is given).
- ``mooncake``: Mooncake JSONL, one object a line with ``timestamp`` (ms), ``input_length``,
  ``output_length`` and optional ``hash_ids`` (ids of 512-token prompt-prefix blocks).
- ``burstgpt``: BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,
  Log Type`` with timestamps in seconds. Rows with 0 response tokens are failed requests in
  BurstGPT; they are skipped and counted in the report under ``failed (0 response tokens)``.

Files may be gzip-compressed and may start with a byte-order mark. Malformed input raises
``TraceFormatError`` naming the file, the line and the problem; nothing is dropped without
being counted in the report, and what looks wrong without being malformed (a Mooncake trace
whose timestamps read as thousands of requests a second) is a warning in it.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, TextIO

import numpy as np

TraceFormat = Literal["azure", "mooncake", "burstgpt"]
TRACE_FORMATS: tuple[str, ...] = ("azure", "mooncake", "burstgpt")
#: Mooncake's ``hash_ids`` each stand for this many prompt tokens.
MOONCAKE_BLOCK_TOKENS = 512

SKIP_BLANK = "blank line"
SKIP_FAILED = "failed (0 response tokens)"
SKIP_OTHER_MODEL = "other model"
SKIP_TOO_LONG = "longer than max_model_len"
SKIP_OUTSIDE_WINDOW = "outside time window"
#: A trace arriving faster than this (requests per trace second, over at least
#: ``MIN_ROWS_FOR_RATE_CHECK`` rows) most likely has its timestamps in the wrong unit.
MAX_PLAUSIBLE_RATE = 1000.0
MIN_ROWS_FOR_RATE_CHECK = 20


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file, the line and what was wrong."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """How to cut and reshape a trace for replay. Times are trace seconds unless noted."""

    #: Arrivals are sped up by this factor (2.0 = twice the request rate).
    time_scale: float = 1.0
    #: Window start, in seconds after the trace's first timestamp (of any row, skipped or not).
    start_s: float = 0.0
    #: Window length in trace seconds; ``None`` = to the end.
    duration_s: float | None = None
    #: Limit on prompt + output tokens (the engine's ``max_model_len``); ``None`` = no limit.
    max_model_len: int | None = None
    #: What to do with longer requests: ``clip`` (cut output, then prompt) or ``skip``.
    overflow: Literal["clip", "skip"] = "clip"
    #: Spread the requests of each ``[k*q, (k+1)*q)`` bucket evenly inside it (for traces
    #: whose timestamps are quantised, e.g. ~3 s for Mooncake). ``None`` = keep as is.
    spread_quantum_s: float | None = None
    #: BurstGPT only: keep only rows of this model (``ChatGPT``, ``GPT-4``; any case); ``None`` = all.
    model: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale!r}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s must be >= 0, got {self.start_s!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0 or None, got {self.duration_s!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (one prompt and one output token), "
                f"got {self.max_model_len!r}"
            )
        if self.overflow not in ("clip", "skip"):
            raise ValueError(f"overflow must be 'clip' or 'skip', got {self.overflow!r}")
        if self.spread_quantum_s is not None and not self.spread_quantum_s > 0:
            raise ValueError(
                f"spread_quantum_s must be > 0 or None, got {self.spread_quantum_s!r}"
            )


@dataclass(slots=True)
class TraceReport:
    """What reading a trace did. ``skipped`` maps a reason to the number of rows it removed."""

    path: str
    format: str
    rows_read: int = 0
    rows_kept: int = 0
    #: Requests shortened to fit ``max_model_len``.
    clipped: int = 0
    #: Requests whose output length was raised to 1 (or prompt length to 1).
    raised_to_one: int = 0
    #: True when the file's rows were not in time order (they are sorted, stably).
    resorted: bool = False
    skipped: dict[str, int] = field(default_factory=dict)
    #: Span of the kept arrivals on the replay clock (after ``time_scale``), seconds.
    span_s: float = 0.0
    #: The longest wait between two kept arrivals (replay clock), and when it ends: a stray
    #: timestamp shows here as one gap that is nearly the whole span.
    max_gap_s: float = 0.0
    max_gap_until_s: float = 0.0
    #: What looks wrong without being malformed (e.g. timestamps in the wrong unit).
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs; says when the rows were re-sorted: the replay order is then not
        the file's, which a reader of the log should know."""
        skips = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        resorted = "; rows re-sorted by arrival time (the file was not in time order)" if self.resorted else ""
        warn = "".join(f"; WARNING: {w}" for w in self.warnings)
        return (
            f"{self.path} ({self.format}): {self.rows_read} rows read, {self.rows_kept} kept, "
            f"{self.clipped} clipped, {self.raised_to_one} raised to 1 token, skipped: {skips}{resorted}{warn}"
        )


@dataclass(frozen=True, slots=True)
class TraceArrays:
    """A trace ready for replay: arrival times (s from the window start, on the replay clock,
    ascending), token counts, and the prefix-block ids when the format has them."""

    arrival_s: np.ndarray  # float64
    prompt_len: np.ndarray  # int64, >= 1
    output_len: np.ndarray  # int64, >= 1
    report: TraceReport
    prefix_hashes: tuple[tuple[int, ...], ...] | None = None
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    #: Replay length: the window length after ``time_scale`` (or the span when unbounded).
    duration_s: float = 0.0

    def __len__(self) -> int:
        return int(self.arrival_s.size)


@dataclass(slots=True)
class _Raw:
    """Rows as parsed, before windowing and clipping."""

    time_s: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    hashes: list[tuple[int, ...]] | None = None
    skipped: Counter = field(default_factory=Counter)
    rows_read: int = 0
    #: Earliest timestamp of any parsed row, skipped ones included: the trace's time origin,
    #: so a window means the same whichever rows a filter removes.
    t0: float = math.inf

    def saw(self, t: float) -> None:
        self.t0 = min(self.t0, t)


# --- field parsing ---------------------------------------------------------------------------
def _tokens(path: Path, line: int, name: str, text: object) -> int:
    """A non-negative whole token count (``"12"``, ``"12.0"`` or a JSON number)."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TraceFormatError(path, line, f"{name} is not a number: {text!r}")
    try:
        v = float(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        raise TraceFormatError(path, line, f"{name} is not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v):
        raise TraceFormatError(path, line, f"{name} is not a whole number: {text!r}")
    if v < 0:
        raise TraceFormatError(path, line, f"{name} is negative: {text!r}")
    return int(v)


def _seconds(path: Path, line: int, name: str, text: object, scale: float = 1.0) -> float:
    """A finite numeric timestamp, times ``scale`` (``1e-3`` for milliseconds)."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TraceFormatError(path, line, f"{name} is not a number: {text!r}")
    try:
        v = float(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        raise TraceFormatError(path, line, f"{name} is not a number: {text!r}") from None
    if not math.isfinite(v):
        raise TraceFormatError(path, line, f"{name} is not finite: {text!r}")
    return v * scale


def _wallclock(path: Path, line: int, text: str) -> float:
    """Seconds since the epoch of an ISO-like wall-clock string (naive = UTC)."""
    s = text.strip()
    try:
        # Python 3.11 accepts 7 fractional digits (keeps 6); "Z" and offsets too.
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise TraceFormatError(path, line, f"TIMESTAMP is not a date-time: {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


# --- format readers --------------------------------------------------------------------------
@contextmanager
def _open_text(path: Path, newline: str | None = None) -> Iterator[TextIO]:
    """A trace file as UTF-8 text: gzip-compressed or not (told by its first bytes, whatever
    its name), a byte-order mark (spreadsheet exports) dropped. Bytes that are not UTF-8 raise
    ``TraceFormatError`` naming the line."""
    with path.open("rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    f = (gzip.open(path, "rt", encoding="utf-8-sig", newline=newline) if gz
         else path.open(encoding="utf-8-sig", newline=newline))
    try:
        with f:
            yield f  # type: ignore[misc]
    except UnicodeDecodeError as e:
        line, byte = _first_undecodable(path, gz)
        raise TraceFormatError(path, line, f"not UTF-8 text ({e.reason}: byte {byte!r}); traces are "
                               "UTF-8 CSV or JSONL, optionally gzip-compressed") from None
    except (OSError, EOFError) as e:  # a damaged gzip stream
        raise TraceFormatError(path, 1, f"cannot be read as {'gzip' if gz else 'a file'}: {e}") from None


def _first_undecodable(path: Path, gz: bool) -> tuple[int, bytes]:
    """The first line (1-based) holding bytes that are not UTF-8, and the first such byte
    (text is decoded in blocks, so the decoder's own position says nothing about lines)."""
    with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
        for n, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return n, raw[e.start:e.start + 1]
    return 1, b""


def _csv_rows(path: Path, required: tuple[str, ...]):
    """Yield (line number, {column: text}) for each data row; checks the header and widths."""
    with _open_text(path, newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceFormatError(path, 1, "file is empty (no header)") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceFormatError(
                path,
                1,
                f"missing column(s) {missing}; header is {header}, expected {list(required)}",
            )
        index = {c: header.index(c) for c in required}
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                yield line, None
                continue
            if len(row) != len(header):
                raise TraceFormatError(
                    path, line, f"expected {len(header)} fields, found {len(row)}: {row!r}"
                )
            yield line, {c: row[i] for c, i in index.items()}


def _read_azure(path: Path, opts: TraceOptions) -> _Raw:
    raw = _Raw()
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        raw.rows_read += 1
        if row is None:
            raw.skipped[SKIP_BLANK] += 1
            continue
        raw.time_s.append(_wallclock(path, line, row["TIMESTAMP"]))
        raw.saw(raw.time_s[-1])
        raw.prompt.append(_tokens(path, line, "ContextTokens", row["ContextTokens"]))
        raw.output.append(_tokens(path, line, "GeneratedTokens", row["GeneratedTokens"]))
    return raw


def _read_burstgpt(path: Path, opts: TraceOptions) -> _Raw:
    raw = _Raw()
    cols = ("Timestamp", "Model", "Request tokens", "Response tokens")
    for line, row in _csv_rows(path, cols):
        raw.rows_read += 1
        if row is None:
            raw.skipped[SKIP_BLANK] += 1
            continue
        t = _seconds(path, line, "Timestamp", row["Timestamp"])
        raw.saw(t)
        prompt = _tokens(path, line, "Request tokens", row["Request tokens"])
        output = _tokens(path, line, "Response tokens", row["Response tokens"])
        if opts.model is not None and row["Model"].strip().casefold() != opts.model.strip().casefold():
            raw.skipped[SKIP_OTHER_MODEL] += 1
            continue
        if output == 0:
            raw.skipped[SKIP_FAILED] += 1
            continue
        raw.time_s.append(t)
        raw.prompt.append(prompt)
        raw.output.append(output)
    return raw


def _read_mooncake(path: Path, opts: TraceOptions) -> _Raw:
    raw = _Raw(hashes=[])
    with _open_text(path) as f:
        for line, text in enumerate(f, start=1):
            raw.rows_read += 1
            if not text.strip():
                raw.skipped[SKIP_BLANK] += 1
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(
                    path, line, f"invalid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise TraceFormatError(
                    path, line, f"expected a JSON object, got {type(obj).__name__}"
                )
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise TraceFormatError(path, line, f"missing field {key!r}; has {sorted(obj)}")
            raw.time_s.append(_seconds(path, line, "timestamp", obj["timestamp"], 1e-3))
            raw.saw(raw.time_s[-1])
            raw.prompt.append(_tokens(path, line, "input_length", obj["input_length"]))
            raw.output.append(_tokens(path, line, "output_length", obj["output_length"]))
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hashes
            ):
                raise TraceFormatError(
                    path, line, f"hash_ids must be a list of integers, got {hashes!r}"
                )
            raw.hashes.append(tuple(hashes))  # type: ignore[union-attr]
    return raw


_READERS = {"azure": _read_azure, "mooncake": _read_mooncake, "burstgpt": _read_burstgpt}


# --- reshaping --------------------------------------------------------------------------------
def spread_in_buckets(t: np.ndarray, quantum_s: float) -> np.ndarray:
    """Spread sorted times evenly inside their ``[k*q, (k+1)*q)`` buckets: the i-th of n
    requests in a bucket goes to ``k*q + i*q/n``. Order is kept; a lone request stays at the
    bucket start (where a quantised trace put it)."""
    if t.size == 0:
        return t.astype(np.float64)
    k = np.floor(t / quantum_s)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, t.size])
    rank = np.arange(t.size) - np.repeat(starts, counts)
    n = np.repeat(counts, counts)
    return k * quantum_s + rank * (quantum_s / n)


def clip_lengths(
    prompt: np.ndarray, output: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Fit each request into ``max_model_len`` tokens: the output is cut first (a prompt keeps
    its length when it fits with at least one output token), then the prompt is cut to
    ``max_model_len - 1``. Returns new arrays and how many requests were shortened."""
    over = prompt + output > max_model_len
    p = np.minimum(prompt, max_model_len - 1)
    o = np.minimum(output, max_model_len - p)
    return p, o, int(over.sum())


@dataclass(slots=True)
class _Rows:
    """The parsed columns while ``read_trace`` shapes them; ``hashes`` (Mooncake's prefix
    blocks, else None) follow every reorder and filter of the arrays."""

    t: np.ndarray  # float64
    prompt: np.ndarray  # int64
    output: np.ndarray  # int64
    hashes: list[tuple[int, ...]] | None

    def reorder(self, order: np.ndarray) -> None:
        self.t, self.prompt, self.output = self.t[order], self.prompt[order], self.output[order]
        if self.hashes is not None:
            self.hashes = [self.hashes[i] for i in order]

    def keep(self, mask: np.ndarray) -> None:
        """Keep the rows where ``mask`` is true (the times as they are)."""
        self.t, self.prompt, self.output = self.t[mask], self.prompt[mask], self.output[mask]
        if self.hashes is not None:
            self.hashes = [h for h, k in zip(self.hashes, mask) if k]


def _in_time_order(raw: _Raw, opts: TraceOptions, report: TraceReport) -> _Rows:
    """The parsed rows sorted by time (stable; the report says when the file was not in order),
    timed from the trace's first timestamp, quantised buckets spread when asked."""
    rows = _Rows(np.asarray(raw.time_s, dtype=np.float64), np.asarray(raw.prompt, dtype=np.int64),
                 np.asarray(raw.output, dtype=np.int64), raw.hashes)
    if rows.t.size and np.any(np.diff(rows.t) < 0):
        rows.reorder(np.argsort(rows.t, kind="stable"))
        report.resorted = True
    if rows.t.size:
        rows.t = rows.t - raw.t0
    if opts.spread_quantum_s is not None:
        rows.t = spread_in_buckets(rows.t, opts.spread_quantum_s)
    return rows


def _window(rows: _Rows, opts: TraceOptions, skipped: Counter) -> None:
    """Keep ``[start_s, start_s + duration_s)``, moved to 0 and divided by ``time_scale`` (the
    replay clock); the rows outside are counted in ``skipped``."""
    end = math.inf if opts.duration_s is None else opts.start_s + opts.duration_s
    keep = (rows.t >= opts.start_s) & (rows.t < end)
    if not keep.all():
        skipped[SKIP_OUTSIDE_WINDOW] += int((~keep).sum())
    rows.keep(keep)
    rows.t = (rows.t - opts.start_s) / opts.time_scale


def _fit_lengths(rows: _Rows, opts: TraceOptions, report: TraceReport, skipped: Counter) -> None:
    """Raise zero token counts to 1, then clip or skip (``overflow``) what exceeds
    ``max_model_len``; a clipped prompt keeps only the prefix blocks that still cover it."""
    low = (rows.prompt < 1) | (rows.output < 1)
    report.raised_to_one = int(low.sum())
    rows.prompt = np.maximum(rows.prompt, 1)
    rows.output = np.maximum(rows.output, 1)
    if opts.max_model_len is None:
        return
    m = opts.max_model_len
    over = rows.prompt + rows.output > m
    if opts.overflow == "skip":
        if over.any():
            skipped[SKIP_TOO_LONG] += int(over.sum())
        rows.keep(~over)
        return
    rows.prompt, rows.output, report.clipped = clip_lengths(rows.prompt, rows.output, m)
    if rows.hashes is not None and over.any():
        # Keep only the blocks that still cover part of the (shortened) prompt.
        nblk = -(-rows.prompt // MOONCAKE_BLOCK_TOKENS)
        rows.hashes = [h[: int(n)] for h, n in zip(rows.hashes, nblk)]


def _describe(report: TraceReport, t: np.ndarray, format: str, opts: TraceOptions) -> None:
    """Fill the report's span and longest gap (replay clock), and warn when a Mooncake trace
    arrives implausibly fast (timestamps most likely in seconds, not milliseconds)."""
    report.rows_kept = int(t.size)
    report.span_s = float(t[-1] - t[0]) if t.size else 0.0
    if t.size > 1:
        gaps = np.diff(t)
        i = int(np.argmax(gaps))
        report.max_gap_s, report.max_gap_until_s = float(gaps[i]), float(t[i + 1])
    rate = t.size / report.span_s * opts.time_scale if report.span_s > 0 else math.inf
    if format == "mooncake" and t.size >= MIN_ROWS_FOR_RATE_CHECK and rate > MAX_PLAUSIBLE_RATE:
        report.warnings.append(
            f"{t.size} requests within {report.span_s * opts.time_scale:.3g} trace seconds "
            f"({rate:,.0f} req/s): Mooncake timestamps are milliseconds; if this file's are "
            f"seconds, set workload.time_scale=0.001")


def read_trace(
    path: str | Path, format: str, options: TraceOptions | None = None
) -> TraceArrays:
    """Read a trace file and shape it for replay (see ``TraceOptions``).

    Steps, in order: parse; sort by time (stable; the report says if needed); make times
    relative to the trace's first timestamp (skipped rows included); spread quantised buckets;
    keep the window ``[start_s, start_s + duration_s)`` and shift it to 0; divide by
    ``time_scale``; raise zero token counts to 1; clip or skip requests longer than
    ``max_model_len``.
    """
    opts = options or TraceOptions()
    p = Path(path)
    if format not in _READERS:
        raise ValueError(f"unknown trace format {format!r}; expected one of {TRACE_FORMATS}")
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    raw = _READERS[format](p, opts)
    report = TraceReport(path=str(p), format=format, rows_read=raw.rows_read)
    skipped: Counter = Counter(raw.skipped)
    rows = _in_time_order(raw, opts, report)
    _window(rows, opts, skipped)
    _fit_lengths(rows, opts, report, skipped)
    report.skipped = dict(skipped)
    t = rows.t
    _describe(report, t, format, opts)
    if opts.duration_s is not None:
        duration = opts.duration_s / opts.time_scale
    else:
        duration = float(t[-1]) if t.size else 0.0
    return TraceArrays(
        arrival_s=t,
        prompt_len=rows.prompt,
        output_len=rows.output,
        report=report,
        prefix_hashes=tuple(rows.hashes) if rows.hashes is not None else None,
        duration_s=duration,
    )
