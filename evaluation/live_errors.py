"""How the live evaluation fails: its error types, and the wait on a condition that gives up
with one line naming what it waited for, the gateway's log's last lines and vLLM's logs (so the
script says why without a traceback)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import httpx


class LiveEvaluationError(RuntimeError):
    """A configuration or start-up problem, said in one line."""


class LiveEvaluationInterrupted(KeyboardInterrupt):
    """Ctrl-C mid-run, after the gateway was stopped and the finished runs were written as
    partial results (results.json meta ``complete: false``); a ``KeyboardInterrupt`` still,
    so a caller that does not know it stops as before."""

    def __init__(self, done: int, total: int, out_dir: Path) -> None:
        super().__init__(f"interrupted after {done} of {total} runs; partial results in {out_dir}")
        self.done, self.total, self.out_dir = done, total, out_dir


def log_tail(path: Path | None, n: int = 4, width: int = 200) -> str:
    """The last ``n`` non-blank lines of a log, on one line (each cut to ``width``), for an
    error that must say why without a traceback; '' when there is no such file."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln[:width] for ln in lines[-n:])


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.25,
               alive: Callable[[], str | None] | None = None, log: Path | None = None) -> None:
    """Poll ``cond`` until true; a ``LiveEvaluationError`` naming ``what`` (and the last lines
    of ``log``, the gateway's) after ``timeout_s``, so the script says it in one line. ``alive``
    returns a reason to give up early (a process that exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None and (why := alive()) is not None:
            raise LiveEvaluationError(_with_tail(f"while waiting for {what}: {why}", log))
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise LiveEvaluationError(_with_tail(f"{what}: not reached after {timeout_s:g} s", log))
        time.sleep(poll_s)


def engine_logs(folder: Path) -> list[Path]:
    """The managed vLLM's logs the gateway writes into ``folder`` (``serve.log_dir``: the run's
    ``out_dir``), one ``vllm-<port>.log`` per engine port."""
    return sorted(folder.glob("vllm-*.log"))


def _with_tail(msg: str, log: Path | None) -> str:
    tail = log_tail(log)
    if tail:
        msg = f"{msg}; last lines of {log}: {tail}"
    elif log is not None and log.is_file():
        msg = f"{msg}; see {log}"
    engines = engine_logs(log.parent) if log is not None else []
    return msg + (f"; vLLM's log: {', '.join(map(str, engines))}" if engines else "")
