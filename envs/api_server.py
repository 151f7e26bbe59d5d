"""vLLM's own admission at its API server, as ``vllm serve`` 0.32 applies it.

Read from the installed vLLM (``vllm/v1/engine/async_llm.py AsyncLLM.check_admission``,
``vllm/config/scheduler.py``, ``vllm/exceptions.py``); every ``/v1/completions`` and
``/v1/chat/completions`` request passes that check before it is tokenized or queued:

- ``--max-num-queued-reqs N``: refused while ``unfinished + n > N``, where ``unfinished`` counts
  every request the API server holds (waiting *and* running, until its last output arrives;
  ``OutputProcessor.request_states``) and ``n`` is the request's sequences (its ``n``). So it
  bounds requests in flight, not only the waiting queue.
- ``--max-num-queued-tokens T``: refused while the prompt tokens of the requests that have not
  produced a first token (``is_prefilling``; a chunked prefill under way counts its whole
  prompt) add up to ``T`` or more. The arriving request's own prompt is not counted: one long
  prompt is taken while the backlog is below ``T``.
- Both answer HTTP 503 with the messages below (``QueueOverflowError``,
  ``MaxQueuedTokensError``); the request never reaches the engine.
- ``--max-num-active-seqs A`` (``<= max_num_seqs``) is not an API-server check: the scheduler
  admits at most ``A`` requests into RUNNING; the rest wait in its queue
  (``SimEngine`` does the same).

vLLM's docs suggest ``T`` of about the TTFT objective times the deployment's prefill throughput.
The simulator (``SimEngine.add_request``) refuses with ``RequestRejected(reason=...)``, the
reason being the flag's name, so an evaluation counts a refusal as a miss.

One difference a real server has and the simulator does not: the check runs before the request
is registered, with awaits (tokenization) in between, so requests of a burst that arrive within
the same few milliseconds may all pass it before any of them is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The reason slugs (the flags' names) and vLLM's 503 message for each.
API_SERVER_503: dict[str, str] = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
                           "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
                             "Please try again later or on a different instance.",
}


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` (None: no limit)."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name}={v} must be >= 0 or None (no limit)")

    @property
    def active(self) -> bool:
        return self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None

    def refusal(self, unfinished: int, queued_tokens: int, n: int = 1) -> str | None:
        """The reason vLLM's API server refuses a request of ``n`` sequences arriving while
        ``unfinished`` requests are in flight and ``queued_tokens`` prompt tokens await their
        first token; None when it takes it. Same order and comparisons as ``check_admission``."""
        if self.max_num_queued_reqs is not None and unfinished + n > self.max_num_queued_reqs:
            return "max_num_queued_reqs"
        if self.max_num_queued_tokens is not None and queued_tokens >= self.max_num_queued_tokens:
            return "max_num_queued_tokens"
        return None
