"""The live evaluation's vLLM sampler (``evaluation/live_metrics.py``) against a real HTTP server
whose /metrics page is malformed for a while: the sampler used to catch only httpx's errors, so
the parser's ``ValueError`` ended its thread silently and a run's peaks stopped where it died."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchpilot.evaluation.live_metrics import VllmSampler

GOOD = ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n"
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 7.0\n")
BAD = GOOD.replace("vllm:num_requests_running{engine=\"0\"} 7.0", "vllm:num_requests_running{engine=\"0\"} seven")


class _Pages:
    """The pages the server answers, one per GET /metrics, the last one repeated."""

    def __init__(self, pages: list[str]) -> None:
        self.pages, self.served = pages, 0
        self.lock = threading.Lock()

    def next(self) -> str:
        with self.lock:
            page = self.pages[min(self.served, len(self.pages) - 1)]
            self.served += 1
            return page


@pytest.fixture
def metrics_server() -> Iterator[Callable[[list[str]], tuple[str, _Pages]]]:
    servers: list[ThreadingHTTPServer] = []

    def start(pages: list[str]) -> tuple[str, _Pages]:
        src = _Pages(pages)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = src.next().encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", src

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.01)


def test_a_malformed_page_is_counted_said_and_sampling_goes_on(metrics_server, caplog) -> None:
    url, src = metrics_server([BAD, BAD, GOOD])
    caplog.set_level(logging.WARNING, logger="batchpilot.evaluation.live_metrics")
    with VllmSampler(url, interval_s=0.01) as sampler:
        # the good pages after the bad ones are still read: the thread did not end on the first
        _wait_for(lambda: sampler.pages >= 5, "five pages sampled")
        assert sampler._thread.is_alive()
    assert sampler.bad_pages == 2
    assert sampler.peak_kv == pytest.approx(0.25) and sampler.peak_running == 7.0
    assert sampler.mean_running == 7.0  # the bad pages add no zero samples
    assert "num_requests_running" in sampler.last_error and "seven" in sampler.last_error
    said = sampler.problem()
    assert said.startswith(f"2 of {sampler.pages} /metrics pages of {url} were not Prometheus text")
    assert "seven" in said
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and url in warned[0] and "seven" in warned[0]  # said once, then counted


def test_a_clean_run_has_nothing_to_say(metrics_server) -> None:
    url, _ = metrics_server([GOOD])
    with VllmSampler(url, interval_s=0.01) as sampler:
        _wait_for(lambda: sampler.pages >= 2, "two pages sampled")
    assert (sampler.bad_pages, sampler.last_error, sampler.problem()) == (0, "", "")
    assert sampler.peak_running == 7.0
