"""``Admission.submit_or_admit`` (the environment's path for a request that arrives alone) leaves
the state ``submit`` then ``admit`` leave, on random sequences of arrivals, first tokens and
finishes, in every mode (caps, long prompts, memory, the prefill hold, lateness, shedding)."""

from __future__ import annotations

import random

import pytest

from batchpilot.core.admission import Admission, AdmissionConfig
from batchpilot.core.engine import Request
from batchpilot.core.knobs import BUCKETING_MODES, Knobs


class _Memory:
    """A memory check with a small ceiling, so that it binds."""

    def __init__(self, ceiling_blocks: int) -> None:
        self.ceiling = ceiling_blocks

    def request_blocks(self, prompt_len: int, output_len: int, num_seqs: int = 1) -> int:
        return num_seqs * max(1, -(-(prompt_len + output_len) // 16))

    def fits(self, kv_blocks: int, num_seqs: int, kv_dtype: str) -> bool:
        return kv_blocks + num_seqs <= self.ceiling


def _state(a: Admission) -> tuple:
    return (a.num_submitted, a.num_admitted, a.num_finished, a.num_in_flight, a.num_waiting,
            dict(a.num_rejected_by_reason), a.num_seqs_in_flight, a.kv_blocks_in_flight, a.num_long_in_flight,
            a.prefill_tokens_in_flight, dict(a._awaiting_first), {k: v[:3] for k, v in a._in_flight.items()},
            list(a._pass), a._vtime, a._seq, a.queue_depths, a.num_late_waiting, a.first_token_s)


def _pair(rng: random.Random, mode: str) -> tuple[Admission, Admission]:
    cfg = dict(on_time_first=rng.random() < 0.7, max_num_long=rng.choice([1, 3, 32]),
               prefill_backlog_budgets=rng.choice([None, 1.0, 4.0]), first_token_margin=rng.random() < 0.5,
               max_wait_s=rng.choice([None, None, 3.0]))
    cap = rng.choice([1, 2, 4, 16, 64])
    memory = _Memory(rng.choice([60, 200, 10_000, 10_000])) if rng.random() < 0.6 else None
    ttft_ms = rng.choice([None, 500.0, 2000.0])
    out = []
    for _ in range(2):
        a = Admission(AdmissionConfig(**cfg), Knobs(cap, mode), memory=memory)
        a.use_slo(ttft_ms)
        a.use_token_budget(2048)
        out.append(a)
    return out[0], out[1]


@pytest.mark.parametrize("mode", BUCKETING_MODES)
@pytest.mark.parametrize("seed", range(12))
def test_submit_or_admit_equals_submit_then_admit(mode: str, seed: int) -> None:
    rng = random.Random(seed * 7919 + len(mode))
    plain, fast = _pair(rng, mode)
    now, n, admitted_plain, admitted_fast = 0.0, 0, [], []
    for _ in range(400):
        now += rng.expovariate(2.0)
        op = rng.random()
        if op < 0.4:  # one arrival, a little in the past sometimes (the engine's clock runs ahead)
            out = rng.choice([1, 64, 600])  # admission charges max_tokens (none sent: the prompt alone)
            r = Request(f"r{n}", now - rng.choice([0.0, 0.0, 0.3, 5.0]), rng.choice([10, 900, 1500, 3000, 9000]),
                        out, rng.choice([0, 0, 1, 2]), num_seqs=rng.choice([1, 1, 1, 2]),
                        max_tokens=rng.choice([None, out, out + 1024]))
            n += 1
            rej_p = plain.submit(r, now)
            rej_f, took = fast.submit_or_admit(r, now)
            assert (rej_p is None) == (rej_f is None) and (rej_p is None or rej_p.reason == rej_f.reason)
            if took:
                admitted_fast.append(r.request_id)
            for a, got in ((plain, admitted_plain), (fast, admitted_fast)):
                if a.expires:
                    a.expire(now)
                got.extend(x.request_id for x in a.admit(now))
                a.take_rejections()
        elif op < 0.65 and plain._awaiting_first:  # the engine's prefill comes out, for some or all
            for rid in sorted(plain._awaiting_first)[: rng.choice([1, 100])]:
                assert plain.on_first_token(rid, now) == fast.on_first_token(rid, now)
        elif op < 0.95 and plain._in_flight:
            rid = rng.choice(sorted(plain._in_flight))
            plain.on_finished(rid)
            fast.on_finished(rid)
        elif op < 0.97:
            level = rng.choice([None, None, 0, 1])
            assert len(plain.shed(level, now, persist=True)) == len(fast.shed(level, now, persist=True))
        else:
            cap = rng.choice([1, 3, 8])
            for a in (plain, fast):
                a.set_knobs(Knobs(cap, mode))
        assert admitted_plain == admitted_fast
        assert _state(plain) == _state(fast)
        fast.check_counts()
    assert seed % 4 or admitted_fast, "nothing admitted: the sequence exercises too little"


def test_a_request_alone_with_room_is_taken_at_once_and_never_queued() -> None:
    a = Admission(AdmissionConfig(), Knobs(4, "fifo"), memory=_Memory(10_000))
    a.use_slo(1000.0)
    a.use_token_budget(8192)
    assert a.submit_or_admit(Request("a", 0.0, 100, 10), 0.0) == (None, True)
    assert a.num_in_flight == 1 and a.num_waiting == 0 and a.prefill_tokens_in_flight == 100
    assert not a._lateness and not any(h for b in a._buckets for pair in b.heaps for h in pair)
    assert a.admit(0.0) == []
    # something waits already: plain submit, admit decides
    b = Admission(AdmissionConfig(max_num_long=0), Knobs(4, "fifo"))
    assert b.submit_or_admit(Request("long", 0.0, 5000, 10), 0.0) == (None, False)
    assert b.submit_or_admit(Request("short", 0.0, 100, 10), 0.0) == (None, False)
    assert [r.request_id for r in b.admit(0.0)] == ["short"]
