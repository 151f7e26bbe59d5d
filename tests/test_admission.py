"""Admission: bucket routing, serving order per mode, caps, rejections, and the books balancing."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from batchpilot.core.admission import Admission, AdmissionConfig, depths_padded
from batchpilot.core.engine import Request
from batchpilot.core.knobs import BUCKETING_MODES, Knobs

_ids = itertools.count()


def req(prompt_len: int, t: float = 0.0, priority: int = 0, rid: str | None = None) -> Request:
    return Request(rid or f"r{next(_ids)}", t, prompt_len, 16, priority)


def make(cap: int = 100, mode: str = "fifo", **cfg) -> Admission:
    return Admission(AdmissionConfig(**cfg), Knobs(cap, mode))


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_bucket_routing_at_boundaries():
    a = make()
    assert [a.bucket_of(n) for n in (1, 1023, 1024, 8191, 8192, 100_000)] == [0, 0, 1, 1, 2, 2]
    for n in (10, 2000, 3000, 9000):
        assert a.submit(req(n), 0.0) is None
    assert a.queue_depths == (1, 2, 1)
    assert make(boundaries=(100, 200, 300), weights=(1, 1, 1, 1)).queue_depths == (0, 0, 0, 0)


def test_fifo_serves_oldest_across_buckets():
    a = make(cap=10, mode="fifo")
    order = [(9000, 0.0, "L"), (10, 1.0, "S"), (2000, 2.0, "M"), (20, 3.0, "S2")]
    for n, t, rid in order:
        a.submit(req(n, t, rid=rid), t)
    assert ids(a.admit(4.0)) == ["L", "S", "M", "S2"]


def test_shortest_first_drains_short_bucket_first():
    a = make(cap=10, mode="shortest_first")
    for n, t, rid in [(9000, 0.0, "L"), (2000, 1.0, "M"), (10, 2.0, "S"), (20, 3.0, "S2")]:
        a.submit(req(n, t, rid=rid), t)
    assert ids(a.admit(4.0)) == ["S", "S2", "M", "L"]


def test_weighted_shares_follow_weights():
    a = make(cap=100, mode="weighted", weights=(0.5, 0.3, 0.2))
    for i in range(100):
        for n in (10, 2000, 9000):
            a.submit(req(n, float(i)), float(i))
    got = a.admit(200.0)
    counts = [sum(a.bucket_of(r.prompt_len) == b for r in got) for b in range(3)]
    assert len(got) == 100
    assert all(abs(c - e) <= 1 for c, e in zip(counts, (50, 30, 20))), counts


def test_weighted_idle_bucket_banks_no_credit():
    """A bucket that was empty for a long time must not then monopolise admissions."""
    a = make(cap=1000, mode="weighted", weights=(1, 1, 1))
    for i in range(60):
        a.submit(req(10, float(i)), float(i))
    assert len(a.admit(60.0)) == 60  # only short ones: bucket 0's pass runs far ahead
    a.set_knobs(Knobs(60 + 20, "weighted"))
    for i in range(20):
        a.submit(req(10, 100.0 + i), 100.0 + i)
        a.submit(req(9000, 100.0 + i), 100.0 + i)
    got = a.admit(200.0)
    long_ = sum(r.prompt_len == 9000 for r in got)
    assert 9 <= long_ <= 11, long_  # fair share from now on, not 20 in a row


def test_priority_breaks_ties_within_bucket():
    a = make(cap=10, mode="fifo")
    a.submit(req(10, 0.0, priority=2, rid="p2-old"), 0.0)
    a.submit(req(10, 1.0, priority=0, rid="p0"), 1.0)
    a.submit(req(10, 2.0, priority=2, rid="p2-new"), 2.0)
    a.submit(req(10, 0.5, priority=1, rid="p1"), 2.0)
    assert ids(a.admit(3.0)) == ["p0", "p1", "p2-old", "p2-new"]


def test_in_flight_cap_and_finish_frees_slot():
    a = make(cap=2)
    for i in range(5):
        a.submit(req(10, float(i), rid=f"q{i}"), float(i))
    assert ids(a.admit(5.0)) == ["q0", "q1"]
    assert a.admit(5.0) == []
    a.on_finished("q0")
    assert ids(a.admit(6.0)) == ["q2"]
    assert a.num_in_flight == 2 and a.num_waiting == 2
    a.set_knobs(Knobs(1, "fifo"))  # lowering preempts nothing...
    assert a.num_in_flight == 2
    a.on_finished("q1")
    assert a.admit(7.0) == []  # ...but admits nothing until below the new cap
    a.on_finished("q2")
    assert ids(a.admit(8.0)) == ["q3"]


def test_long_cap_does_not_block_shorter_requests():
    a = make(cap=10, max_num_long=2, long_prompt_threshold=2048)
    for i in range(4):
        a.submit(req(4000, float(i), rid=f"long{i}"), float(i))  # medium bucket, but long
    a.submit(req(1500, 10.0, rid="med"), 10.0)  # same bucket, not long
    a.submit(req(9000, 11.0, rid="huge"), 11.0)
    got = ids(a.admit(12.0))
    assert got == ["long0", "long1", "med"]
    assert a.num_long_in_flight == 2
    a.on_finished("long0")
    assert ids(a.admit(13.0)) == ["long2"]
    assert a.num_waiting == 2


def test_queue_full_rejects_new_request():
    a = make(cap=1, max_queue_len=2)
    assert a.submit(req(10), 0.0) is None
    assert a.submit(req(10), 0.0) is None
    rej = a.submit(req(10, rid="third"), 0.0)
    assert rej is not None and rej.reason == "queue_full" and rej.request_id == "third"
    assert a.submit(req(5000), 0.0) is None  # other buckets have their own limit
    assert a.num_rejected_by_reason == {"queue_full": 1}


def test_expire_rejects_only_stale_requests():
    a = make(cap=1, max_wait_s=5.0)
    a.submit(req(10, 0.0, rid="old"), 0.0)
    a.submit(req(10, 3.0, rid="mid"), 3.0)
    a.submit(req(10, 6.0, rid="new"), 6.0)
    assert [r.request_id for r in a.expire(7.0)] == ["old"]
    assert ids(a.admit(7.0)) == ["mid"]  # admitted, so it never times out
    rej = a.expire(100.0)
    assert [(r.request_id, r.reason) for r in rej] == [("new", "timeout")]
    assert a.num_waiting == 0 and a.admit(100.0) == []
    a.check_counts()


def test_shed_keeps_core_one_shot_or_persistent():
    # Every priority above the kept one: the least important class alone is test_class_rules'.
    a = make(cap=1, shed_least_important_first=False)
    for p in (0, 1, 2, 0, 3):
        a.submit(req(10, priority=p, rid=f"p{p}-{next(_ids)}"), 0.0)
    rej = a.shed(0, now=1.0)
    assert sorted(r.request.priority for r in rej) == [1, 2, 3]
    assert all(r.reason == "shed_low_priority" for r in rej)
    assert a.num_waiting == 2
    assert a.submit(req(10, priority=1, rid="late"), 1.0) is None  # one-shot: new ones queue
    assert [r.request_id for r in a.shed(0, 1.5, persist=True)] == ["late"]
    assert a.submit(req(10, priority=1), 1.0).reason == "shed_low_priority"
    assert a.submit(req(10, priority=0), 1.0) is None
    assert a.shed(None) == []
    assert a.submit(req(10, priority=5), 2.0) is None
    assert all(r.priority == 0 for r in a.admit(3.0))
    a.check_counts()


def test_cancel_waiting_and_in_flight():
    a = make(cap=1)
    a.submit(req(10, rid="run"), 0.0)
    a.submit(req(10, rid="wait"), 0.0)
    a.admit(0.0)
    assert a.cancel("wait", 1.0).reason == "cancelled"
    assert a.cancel("run", 1.0) is None and a.num_in_flight == 0
    assert a.cancel("never-seen", 1.0) is None
    assert a.num_finished == 1 and a.num_rejected_by_reason == {"cancelled": 1}
    a.check_counts()


def test_misuse_raises():
    a = make()
    a.submit(req(10, rid="x"), 0.0)
    with pytest.raises(ValueError, match="already"):
        a.submit(req(10, rid="x"), 0.0)
    with pytest.raises(KeyError):
        a.on_finished("x")  # waiting, not in flight
    with pytest.raises(ValueError, match="bucketing"):
        a.set_knobs(Knobs(4, "random"))
    with pytest.raises(ValueError, match="weights"):
        AdmissionConfig(weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="ascending"):
        AdmissionConfig(boundaries=(8192, 1024))
    with pytest.raises(ValueError, match="Key 'boundary' not in 'AdmissionConfig'"):
        AdmissionConfig.from_cfg({"boundary": [1]})


def test_from_cfg_and_padding():
    cfg = AdmissionConfig.from_cfg({"boundaries": [512, 2048, 8192], "weights": [1, 1, 1, 1]})
    assert cfg.num_buckets == 4
    assert depths_padded((1, 2, 3, 4)) == (1, 2, 7)
    assert depths_padded((1,)) == (1, 0, 0)


def test_adaptive_boundaries_follow_the_workload():
    fixed = make()
    adaptive = make(adapt_boundaries=True, adapt_rate=0.05)
    for i in range(400):
        n = 100 if i % 2 else 3000
        fixed.submit(req(n), 0.0)
        adaptive.submit(req(n), 0.0)
    assert fixed.boundaries == (1024, 8192)
    b = adaptive.boundaries
    assert b[0] < 700, b  # the short centroid moved down towards 100 tokens
    assert b[0] < b[1]


class AdmissionMachine(RuleBasedStateMachine):
    """Random submit/admit/finish/cancel/expire/shed/knob sequences: nothing is ever lost."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Admission(AdmissionConfig(max_queue_len=5, max_wait_s=10.0, max_num_long=2), Knobs(3))
        self.a.use_token_budget(4000)  # the prefill backlog holds at 4000 prompt tokens
        self.now = 0.0
        self.submitted: set[str] = set()
        self.rejected: set[str] = set()
        self.finished: set[str] = set()
        self.in_flight: set[str] = set()
        self.n = 0

    def _rejections(self, rejs) -> None:
        for r in rejs:
            assert r.request_id not in self.rejected
            self.rejected.add(r.request_id)

    @rule(n=st.sampled_from([1, 500, 1500, 3000, 9000]), prio=st.integers(0, 3), age=st.floats(0, 20))
    def submit(self, n, prio, age):
        rid = f"s{self.n}"
        self.n += 1
        self.submitted.add(rid)
        rej = self.a.submit(Request(rid, self.now - age, n, 8, prio), self.now)
        self._rejections([rej] if rej else [])

    @rule()
    def admit(self):
        got = self.a.admit(self.now)
        for r in got:
            assert r.request_id not in self.in_flight | self.finished | self.rejected
            self.in_flight.add(r.request_id)
        if got:
            assert self.a.num_in_flight <= self.a.batch_cap
            # the hold is checked before each admission: only the last may take it past the hold
            assert self.a.prefill_tokens_in_flight - got[-1].prompt_len < self.a.prefill_hold_tokens
        assert self.a.num_long_in_flight <= 2

    @rule(data=st.data())
    def first_token(self, data):
        if self.in_flight:
            self.a.on_first_token(data.draw(st.sampled_from(sorted(self.in_flight))))

    @rule(data=st.data())
    def finish(self, data):
        if self.in_flight:
            rid = data.draw(st.sampled_from(sorted(self.in_flight)))
            self.a.on_finished(rid)
            self.in_flight.remove(rid)
            self.finished.add(rid)

    @rule(data=st.data())
    def cancel(self, data):
        if self.submitted:
            rid = data.draw(st.sampled_from(sorted(self.submitted)))
            was_in_flight = rid in self.in_flight
            rej = self.a.cancel(rid, self.now)
            if was_in_flight:
                self.in_flight.remove(rid)
                self.finished.add(rid)
            self._rejections([rej] if rej else [])

    @rule(dt=st.floats(0, 8))
    def tick(self, dt):
        self.now += dt
        self._rejections(self.a.expire(self.now))

    @rule(level=st.one_of(st.none(), st.integers(0, 2)), persist=st.booleans())
    def shed(self, level, persist):
        self._rejections(self.a.shed(level, self.now, persist=persist))

    @rule(cap=st.integers(1, 8), mode=st.sampled_from(BUCKETING_MODES))
    def knobs(self, cap, mode):
        self.a.set_knobs(Knobs(cap, mode))

    @invariant()
    def books_balance(self):
        a = self.a
        a.check_counts()
        waiting = self.submitted - self.rejected - self.in_flight - self.finished
        assert a.num_waiting == len(waiting)
        assert all(a.is_waiting(r) for r in waiting)
        assert all(a.is_in_flight(r) for r in self.in_flight)
        assert a.num_finished == len(self.finished)
        assert a.num_rejected == len(self.rejected)
        assert 0 <= a.prefill_tokens_in_flight
        if not self.in_flight:
            assert a.prefill_tokens_in_flight == 0


AdmissionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


def test_from_cfg_has_one_spelling():
    """The env and serve configs share one admission schema; the env's old spellings are gone."""
    cfg = AdmissionConfig.from_cfg({"boundaries": [2048], "weights": [0.7, 0.3], "adapt_boundaries": True})
    assert cfg.boundaries == (2048,) and cfg.weights == (0.7, 0.3) and cfg.adapt_boundaries
    with pytest.raises(ValueError, match="bucket_boundaries"):
        AdmissionConfig.from_cfg({"bucket_boundaries": [1]})
    with pytest.raises(ValueError, match="max_queue_len"):
        AdmissionConfig.from_cfg({"max_queue_len": "many"})


def test_sequences_not_requests_count_against_the_cap() -> None:
    """``n > 1``, ``best_of`` and prompt batches run several sequences but took one slot: the
    cap now bounds sequences. A request with more than the cap still runs, alone."""
    from batchpilot.core.engine import Request

    a = Admission(AdmissionConfig(), Knobs(batch_cap=4))
    a.submit(Request("n3", 0.0, 10, 10, num_seqs=3), 0.0)
    a.submit(Request("n2", 0.1, 10, 10, num_seqs=2), 0.1)
    a.submit(Request("big", 0.2, 10, 10, num_seqs=6), 0.2)
    assert [r.request_id for r in a.admit(1.0)] == ["n3"]  # 3 + 2 > 4: n2 waits
    assert a.num_seqs_in_flight == 3
    a.on_finished("n3")
    assert [r.request_id for r in a.admit(2.0)] == ["n2"]  # 2 + 6 > 4: big waits
    a.on_finished("n2")
    assert [r.request_id for r in a.admit(3.0)] == ["big"]  # alone it may exceed the cap
    a.on_finished("big")
    assert a.num_seqs_in_flight == 0 and a.num_in_flight == 0
    a.check_counts()


def test_the_gateway_counts_sequences_per_request() -> None:
    from batchpilot.serving.request_body import num_sequences

    assert num_sequences({"prompt": "x"}, chat=False) == 1
    assert num_sequences({"prompt": "x", "n": 3}, chat=False) == 3
    assert num_sequences({"prompt": "x", "n": 2, "best_of": 5}, chat=False) == 5
    assert num_sequences({"prompt": ["a", "b", "c"], "n": 2}, chat=False) == 6
    assert num_sequences({"prompt": [1, 2, 3]}, chat=False) == 1  # token ids: one prompt
    assert num_sequences({"messages": [{"role": "user", "content": "hi"}], "n": 4}, chat=True) == 4


# --- memory, per request (issue 14) -------------------------------------------------------------
def _capped(rid: str, t: float, prompt_len: int, max_tokens: int, **kw):
    """A request whose client sent ``max_tokens`` (what the memory check charges); its output
    is that long too."""
    return Request(rid, t, prompt_len, max_tokens, max_tokens=max_tokens, **kw)


def _memory_shield(overhead_frac: float = 0.0):
    """test_shield's engine: budget 1000, weights 400 + activations 80; the 80 % ceiling leaves
    320 for KV at 0.0625 a 16-token block (auto), i.e. 5,120 blocks (81,920 tokens)."""
    from test_shield import caps, memory

    from batchpilot.core.shield import Shield, ShieldConfig
    from batchpilot.core.telemetry import SLO

    return Shield(ShieldConfig(overhead_frac=overhead_frac), memory(), caps(), SLO(ttft_ms=1000.0, tpot_ms=100.0))


def test_a_burst_of_long_prompts_is_admitted_by_memory_not_by_count() -> None:
    """Admission used to admit by count: 100 prompts of 4,000 tokens (+ 1,000 out) went in under
    a cap of 100 although 16 of them fill the memory ceiling. Now each admission keeps the
    predicted memory of everything in flight plus it within the ceiling."""

    sh = _memory_shield()
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=sh)
    for i in range(100):
        assert a.submit(_capped(f"L{i}", float(i), 4000, 1000), float(i)) is None
    got = a.admit(100.0)
    per = sh.request_blocks(4000, 1000)
    assert per == 313 and len(got) == 5120 // 313 == 16
    assert a.kv_blocks_in_flight == 16 * per
    assert sh.blocks_fraction(a.kv_blocks_in_flight, 16, "auto") <= 0.80 < sh.blocks_fraction(17 * per, 17, "auto")
    assert a.predicted_fraction() <= 0.80
    # Short requests behind them wait too (the order is kept), until memory frees up.
    a.submit(_capped("short", 200.0, 10, 10), 200.0)
    assert a.admit(200.0) == []
    a.on_finished("L0")
    assert [r.request_id for r in a.admit(201.0)] == ["L16"]
    a.check_counts()


def test_a_request_that_never_fits_is_rejected_with_a_reason_and_core_is_never_shed() -> None:

    sh = _memory_shield()
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=sh)
    rej = a.submit(_capped("huge", 0.0, 80_000, 4_000, priority=0), 0.0)  # 84k tokens > 81,920 alone
    assert rej is not None and rej.reason == "too_large_for_memory"
    rej = a.submit(_capped("n8", 0.0, 10_000, 2_000, priority=0, num_seqs=8), 0.0)  # 8 x 12k tokens
    assert rej is not None and rej.reason == "too_large_for_memory"
    # A core request that fits alone but not now waits (never rejected, never shed).
    assert a.submit(_capped("big", 0.0, 60_000, 1_000, priority=0), 0.0) is None
    assert a.submit(_capped("core", 1.0, 30_000, 1_000, priority=0), 1.0) is None
    assert [r.request_id for r in a.admit(1.0)] == ["big"]
    assert a.admit(2.0) == [] and a.is_waiting("core")
    a.on_finished("big")
    assert [r.request_id for r in a.admit(3.0)] == ["core"]
    assert a.num_rejected_by_reason == {"too_large_for_memory": 2}
    a.check_counts()


def test_a_waiting_request_that_stops_fitting_alone_is_rejected_at_admission() -> None:
    """The model moves (calibration learns the engine holds more per block): a request queued
    behind others that no longer fits even alone is refused when its turn comes, not run."""

    sh = _memory_shield()
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100), memory=sh)
    a.submit(_capped("a", 0.0, 60_000, 1_000), 0.0)
    a.submit(_capped("b", 1.0, 60_000, 1_000), 1.0)
    a.submit(_capped("c", 2.0, 10, 10), 2.0)
    assert [r.request_id for r in a.admit(2.0)] == ["a"]
    sh.kv_calibration = 1.5  # 61k tokens x 1.5 > 81,920
    a.on_finished("a")
    assert [r.request_id for r in a.admit(3.0)] == ["c"]
    assert [(r.request_id, r.reason) for r in a.take_rejections()] == [("b", "too_large_for_memory")]
    assert a.take_rejections() == []
    a.check_counts()


def test_without_a_memory_check_admission_counts_only() -> None:

    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100))
    for i in range(100):
        a.submit(_capped(f"L{i}", float(i), 4000, 1000), float(i))
    assert len(a.admit(100.0)) == 100 and a.kv_blocks_in_flight == 0 and a.predicted_fraction() is None


def test_requests_admitted_by_count_are_booked_once_the_memory_check_is_set() -> None:
    """Requests admitted while the KV budget was unknown (no memory check: by count) were booked
    at 0 KV blocks, so once it was known admission under-counted them (it predicted 1.3 % while
    they needed 245 %) and admitted more. Setting the check books them through it; nothing more
    goes in until they leave room, and setting it again (a new model) books them again."""

    sh = _memory_shield()
    a = Admission(AdmissionConfig(max_num_long=1000), Knobs(batch_cap=100))
    for i in range(40):
        a.submit(_capped(f"L{i}", float(i), 4000, 1000), float(i))
    assert len(a.admit(40.0)) == 40 and a.kv_blocks_in_flight == 0
    a.memory = sh  # the budget is known now
    per = sh.request_blocks(4000, 1000)
    assert a.kv_blocks_in_flight == 40 * per
    assert a.predicted_fraction() == sh.blocks_fraction(40 * per, 40, "auto") > 0.80
    a.submit(_capped("short", 50.0, 10, 10), 50.0)
    assert a.admit(50.0) == []  # over the ceiling already: it waits
    for i in range(23):  # 17 left in flight: still over the ceiling (16 fill it: 5,120 // 313)
        a.on_finished(f"L{i}")
    assert a.admit(60.0) == [] and a.kv_blocks_in_flight == 17 * per
    a.on_finished("L23")
    assert [r.request_id for r in a.admit(61.0)] == ["short"]
    sh.memory = replace(sh.memory, block_size=32)  # a new pool with another block size
    a.memory = sh
    assert a.kv_blocks_in_flight == 16 * sh.request_blocks(4000, 1000) + 1 == 16 * 157 + 1
    a.memory = None
    assert a.kv_blocks_in_flight == 0 and a.predicted_fraction() is None
    a.check_counts()


def test_the_ttft_deadline_refuses_late_requests_above_core_priority_only() -> None:
    """A request that already waited its TTFT objective cannot meet it: with ``ttft_deadline``
    it is refused ("deadline") instead of served late; core requests (priority 0) never are."""
    adm = Admission(AdmissionConfig(ttft_deadline=True), Knobs(batch_cap=1))
    adm.use_slo(1000.0)
    assert adm.expires and adm.deadline_s == 1.0
    for i in range(6):
        assert adm.submit(_capped(f"r{i}", 0.1 * i, 100, 10, priority=i % 2), 0.1 * i) is None
    assert adm.expire(1.0) == []  # nobody has waited 1 s yet
    late = adm.expire(1.25)  # r1 (t=0.1) and ... only those above core priority and > 1 s
    assert [r.request.request_id for r in late] == ["r1"] and all(r.reason == "deadline" for r in late)
    late = adm.expire(5.0)
    assert sorted(r.request.request_id for r in late) == ["r3", "r5"]
    assert adm.num_waiting == 3 and adm.num_rejected_by_reason["deadline"] == 3  # r0, r2, r4 (core) wait on

    off = Admission(AdmissionConfig(), Knobs(batch_cap=1))
    off.use_slo(1000.0)
    assert not off.expires and off.deadline_s is None
    no_slo = Admission(AdmissionConfig(ttft_deadline=True), Knobs(batch_cap=1))
    no_slo.use_slo(None)
    assert not no_slo.expires


class OnTimeFirstMachine(AdmissionMachine):
    """The same random sequences with ``on_time_first`` (in arrival order): requests go late as
    time passes, and still nothing is lost."""

    newest_first_when_late = False

    def __init__(self) -> None:
        super().__init__()
        cfg = AdmissionConfig(max_queue_len=5, max_wait_s=10.0, max_num_long=2, on_time_first=True,
                              newest_first_when_late=self.newest_first_when_late)
        self.a = Admission(cfg, Knobs(3))
        self.a.use_slo(3000.0)
        self.a.use_token_budget(4000)


class NewestFirstMachine(OnTimeFirstMachine):
    """And with the on-time requests taken newest first once any has gone late: a second heap
    per bucket, removed lazily, still loses nothing and counts right."""

    newest_first_when_late = True


for _machine in (OnTimeFirstMachine, NewestFirstMachine):
    _machine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestOnTimeFirstMachine = OnTimeFirstMachine.TestCase
TestNewestFirstMachine = NewestFirstMachine.TestCase


def _on_time_first(mode: str, on: bool = True, ttft_ms: float | None = 1000.0, newest: bool = False) -> Admission:
    adm = Admission(AdmissionConfig(on_time_first=on, newest_first_when_late=newest), Knobs(batch_cap=1, bucketing=mode))
    adm.use_slo(ttft_ms)
    return adm


def _submit(adm: Admission, *reqs: tuple[str, float, int, int]) -> None:
    """Submit (id, arrival, prompt length, priority) requests, each at its arrival; none refused."""
    for rid, t, prompt_len, priority in reqs:
        assert adm.submit(Request(rid, t, prompt_len, 16, priority), t) is None


def _drain(adm: Admission, now: float) -> list[str]:
    out = []
    while adm.num_waiting:
        (r,) = adm.admit(now)
        adm.on_finished(r.request_id)
        out.append(r.request_id)
    return out


@pytest.mark.parametrize("mode", BUCKETING_MODES)
def test_on_time_first_serves_the_requests_that_can_still_meet_their_ttft(mode: str) -> None:
    """Under a backlog a plain queue serves every request after its TTFT objective has passed;
    with ``on_time_first`` those still on time go first, and the late ones after (none refused)."""
    on, off = _on_time_first(mode), _on_time_first(mode, on=False)
    for adm in (on, off):
        _submit(adm, ("old", 0.0, 100, 0), ("older_too", 0.5, 100, 0), ("fresh", 2.0, 100, 0), ("fresher", 2.05, 100, 0))
    assert _drain(on, 2.1) == ["fresh", "fresher", "old", "older_too"]
    assert _drain(off, 2.1) == ["old", "older_too", "fresh", "fresher"]
    assert on.num_rejected == 0 and on.num_finished == 4
    on.check_counts()


@pytest.mark.parametrize("mode", BUCKETING_MODES)
def test_once_a_request_is_late_the_on_time_ones_go_newest_first(mode: str) -> None:
    """Past capacity the oldest on-time request has the least slack left and would mostly go
    late while it is served: with ``newest_first_when_late`` the newest goes first while any
    waiting request is late, and first come, first served returns once none is."""
    adm = _on_time_first(mode, newest=True)
    _submit(adm, ("late", 0.0, 100, 0), ("a", 1.5, 100, 0), ("b", 1.6, 100, 0), ("c", 1.7, 100, 0))
    (r,) = adm.admit(1.8)
    assert r.request_id == "c"  # "late" waited 1.8 s > 1 s: overloaded
    adm.on_finished("c")
    assert _drain(adm, 1.9) == ["b", "a", "late"]
    # nobody late: arrival order
    calm = _on_time_first(mode, newest=True)
    _submit(calm, ("x", 0.0, 100, 0), ("y", 0.1, 100, 0), ("z", 0.2, 100, 0))
    assert _drain(calm, 0.5) == ["x", "y", "z"]
    assert adm.num_rejected == 0 and calm.num_rejected == 0
    adm.check_counts()


def test_newest_first_spans_buckets_and_keeps_priority_first() -> None:
    """FIFO bucketing takes the newest on-time head across buckets; within a bucket priority
    still ranks first (a late core request before an on-time batch one, as without the rule)."""
    adm = _on_time_first("fifo", newest=True)
    _submit(adm, ("late", 0.0, 100, 0), ("short", 1.5, 100, 0), ("medium", 1.7, 2000, 0),
            ("batch_newest", 1.75, 100, 1), ("core_short", 1.6, 100, 0))
    assert _drain(adm, 1.8) == ["medium", "core_short", "short", "late", "batch_newest"]


@pytest.mark.parametrize("late", [False, True])
def test_the_queues_stay_as_small_as_what_waits(late: bool) -> None:
    """Entries leave the heaps lazily; a heap nobody reads (newest first while none is late, or
    the arrival-order one while some are) must still not keep every request it ever held."""
    adm = _on_time_first("fifo", newest=True)
    if late:  # a lower class waits past its TTFT throughout: newest first all along
        _submit(adm, ("stuck", 0.0, 100, 1))
    for i in range(5_000):
        t = 2.0 + i * 0.01
        _submit(adm, (f"r{i}", t, 100, 0))
        (r,) = adm.admit(t)
        assert r.request_id == f"r{i}" and adm.num_late_waiting == late
        adm.on_finished(r.request_id)
    assert adm.num_waiting == late
    sizes = [len(h) for b in adm._buckets for h in (*b.heaps[0], *b.heaps[1], *b.newest)]
    assert max(sizes) <= 2 * (1 + late) + 33, sizes
    adm.check_counts()


def test_the_late_count_follows_the_queue() -> None:
    """``num_late_waiting`` counts the waiting requests past their TTFT objective (the shield's
    view of a backlog that the served requests' TTFT does not show)."""
    adm = _on_time_first("fifo")
    _submit(adm, ("a", 0.0, 100, 0), ("b", 0.2, 100, 0), ("c", 1.8, 100, 0))
    assert adm.num_late_waiting == 0
    (first,) = adm.admit(1.9)  # a and b are late by now; c, on time, goes first
    assert first.request_id == "c" and adm.num_late_waiting == 2
    adm.on_finished("c")
    (second,) = adm.admit(2.0)
    assert second.request_id == "a" and adm.num_late_waiting == 1
    adm.check_counts()


def test_on_time_first_prefers_a_bucket_whose_next_request_is_on_time() -> None:
    """Shortest-first would serve the short bucket's late head; a medium prompt still on time
    goes first, then the short bucket again."""
    adm = _on_time_first("shortest_first")
    _submit(adm, ("short_late", 0.0, 100, 0), ("medium_on_time", 1.5, 2000, 0), ("short_on_time", 1.8, 100, 0))
    assert _drain(adm, 2.0) == ["short_on_time", "medium_on_time", "short_late"]


def test_on_time_first_keeps_priority_first_within_a_bucket() -> None:
    """Lateness ranks after priority: a late core request still goes before an on-time one of
    a lower class in its bucket."""
    adm = _on_time_first("fifo")
    _submit(adm, ("core_late", 0.0, 100, 0), ("batch_on_time", 1.9, 100, 1), ("core_on_time", 1.95, 100, 0))
    assert _drain(adm, 2.0) == ["core_on_time", "core_late", "batch_on_time"]


def test_on_time_first_needs_a_ttft_objective() -> None:
    adm = _on_time_first("fifo", ttft_ms=None)
    assert adm.late_after_s is None
    _submit(adm, ("a", 0.0, 100, 0), ("b", 5.0, 100, 0))
    assert _drain(adm, 6.0) == ["a", "b"]


def _with_margin(rate: float = 1.0, cap_frac: float = 0.5, on: bool = True) -> Admission:
    adm = Admission(AdmissionConfig(first_token_margin=on, first_token_margin_rate=rate,
                                    first_token_margin_max=cap_frac), Knobs(batch_cap=1, bucketing="fifo"))
    adm.use_slo(1000.0)
    return adm


@pytest.mark.parametrize("on", [True, False])
def test_the_first_token_margin_counts_a_request_late_before_its_objective(on: bool) -> None:
    """Admitted 0.7 s after arrival with 0.4 s from admission to first token, a request misses
    a 1 s TTFT: with the margin measured, it counts as late at 0.6 s of waiting, and an on-time
    request goes before it; without it, it is still on time then."""
    adm = _with_margin(on=on)
    _submit(adm, ("probe", 0.0, 100, 0))
    (r,) = adm.admit(0.0)
    adm.on_first_token("probe", 0.4)  # 0.4 s from admission to first token
    adm.on_finished("probe")
    assert adm.late_margin_s == pytest.approx(0.4 if on else 0.0)
    _submit(adm, ("waited", 1.0, 100, 0), ("fresh", 1.65, 100, 0))
    order = _drain(adm, 1.7)  # "waited" has waited 0.7 s: past 1 s - 0.4 s, not past 1 s
    assert order == (["fresh", "waited"] if on else ["waited", "fresh"])
    assert adm.num_rejected == 0
    adm.check_counts()


def test_the_margin_is_an_average_bounded_by_its_share_of_the_objective() -> None:
    adm = _with_margin(rate=0.5, cap_frac=0.25)
    for i, (t_admit, t_first) in enumerate([(0.0, 0.1), (1.0, 1.3)]):
        _submit(adm, (f"r{i}", t_admit, 100, 0))
        adm.admit(t_admit)
        adm.on_first_token(f"r{i}", t_first)
        adm.on_first_token(f"r{i}", t_first + 5.0)  # idempotent: one sample per request
        adm.on_finished(f"r{i}")
    assert adm.first_token_s == pytest.approx(0.2)  # 0.1, then halfway to 0.3
    assert adm.late_margin_s == pytest.approx(0.2)
    _submit(adm, ("slow", 2.0, 100, 0))
    adm.admit(2.0)
    adm.on_first_token("slow", 4.0)  # 2 s: the average moves to 1.1 s, the margin stops at 0.25 s
    assert adm.first_token_s == pytest.approx(1.1)
    assert adm.late_margin_s == pytest.approx(0.25)
    adm.on_first_token("never_admitted", 9.0)  # unknown ids: a no-op, no sample
    assert adm.first_token_s == pytest.approx(1.1)


def test_an_untimed_first_token_and_a_missing_objective_add_no_margin() -> None:
    adm = _with_margin()
    _submit(adm, ("a", 0.0, 100, 0))
    adm.admit(0.0)
    adm.on_first_token("a")  # no time given: it leaves the backlog, no sample
    assert adm.first_token_s is None and adm.late_margin_s == 0.0
    adm.on_finished("a")
    _submit(adm, ("b", 1.0, 100, 0))
    adm.admit(1.0)
    adm.on_first_token("b", 1.3)
    adm.use_slo(None)
    assert adm.late_margin_s == 0.0


@pytest.mark.parametrize("key, value", [("first_token_margin_rate", 0.0), ("first_token_margin_rate", 1.5),
                                        ("first_token_margin_max", 1.0), ("first_token_margin_max", -0.1)])
def test_bad_margin_settings_are_named(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=key):
        AdmissionConfig.from_cfg({key: value})


def _held(budget: int | None = 1000, **cfg) -> Admission:
    adm = make(cap=100, **cfg)
    adm.use_token_budget(budget)
    return adm


def test_the_prefill_backlog_holds_requests_until_first_tokens_come() -> None:
    """An engine's own queue is first come, first served: admission keeps requests here while
    the prompts in flight without a first token fill the engine's token budget."""
    adm = _held(1000)
    a, b, c, d = (req(600, rid=x) for x in "abcd")
    for r in (a, b, c, d):
        adm.submit(r, 0.0)
    assert ids(adm.admit(0.0)) == ["a", "b"]  # 600 < 1000 lets b in; 1200 holds the rest
    assert adm.prefill_tokens_in_flight == 1200
    assert adm.admit(0.0) == []
    adm.on_first_token("a")
    adm.on_first_token("a")  # idempotent
    assert adm.prefill_tokens_in_flight == 600
    assert ids(adm.admit(0.1)) == ["c"]
    adm.on_finished("b")  # finished (or failed) before its first token: it leaves the backlog too
    assert ids(adm.admit(0.2)) == ["d"]
    adm.on_first_token("unknown")  # finished already: a no-op
    adm.check_counts()


def test_a_prompt_larger_than_the_budget_runs_alone() -> None:
    adm = _held(1000)
    adm.submit(req(5000, rid="big"), 0.0)
    adm.submit(req(10, rid="small"), 0.0)
    assert ids(adm.admit(0.0)) == ["big"]
    adm.on_first_token("big")
    assert ids(adm.admit(0.0)) == ["small"]


def test_requests_whose_first_token_is_not_seen_count_nothing() -> None:
    """A gateway does not see the first token of an answer that is not streamed."""
    adm = _held(1000)
    for i in range(3):
        adm.submit(Request(f"n{i}", 0.0, 900, 16, reports_first_token=False), 0.0)
    assert len(adm.admit(0.0)) == 3
    assert adm.prefill_tokens_in_flight == 0


@pytest.mark.parametrize("budget, setting", [(None, 1.0), (1000, None)])
def test_without_a_token_budget_or_with_the_hold_off_admission_does_not_hold(budget, setting) -> None:
    adm = _held(budget, prefill_backlog_budgets=setting)
    for i in range(5):
        adm.submit(req(900, rid=f"x{i}"), 0.0)
    assert len(adm.admit(0.0)) == 5
    assert adm.prefill_hold_tokens is None


def test_the_hold_counts_in_token_budgets() -> None:
    adm = _held(1000, prefill_backlog_budgets=2.5)
    assert adm.prefill_hold_tokens == 2500
    with pytest.raises(ValueError, match="prefill_backlog_budgets"):
        AdmissionConfig(prefill_backlog_budgets=0.0)
    with pytest.raises(ValueError, match="prefill_backlog_budgets"):
        AdmissionConfig.from_cfg({"prefill_backlog_budgets": float("nan")})


@pytest.mark.parametrize("mode", BUCKETING_MODES)
def test_a_refusal_for_lack_of_time_keeps_newest_first_for_one_objective(mode: str) -> None:
    """With the TTFT deadline the late requests are refused, not kept, so none waits late: the
    overload they showed keeps the on-time ones newest first for one objective after the last
    refusal, and first come, first served returns after that."""
    adm = Admission(AdmissionConfig(ttft_deadline=True, deadline_max_priority_kept=-1, newest_first_when_late=True),
                    Knobs(batch_cap=1, bucketing=mode))
    adm.use_slo(1000.0)
    _submit(adm, ("late", 0.0, 100, 0), ("a", 0.5, 100, 0), ("b", 0.6, 100, 0), ("c", 0.7, 100, 0))
    (refused,) = adm.expire(1.05)
    assert (refused.request_id, refused.reason) == ("late", "deadline") and adm.num_late_waiting == 0
    (r,) = adm.admit(1.1)
    assert r.request_id == "c"  # overloaded a moment ago: newest on time first
    adm.on_finished("c")
    assert [x.request_id for x in adm.expire(2.3)] == ["a", "b"]  # both waited past 1 s: refused at 2.3
    _submit(adm, ("e", 2.5, 100, 0), ("f", 2.6, 100, 0), ("g", 2.7, 100, 0))
    (r,) = adm.admit(3.2)  # 0.9 s after the last refusal: still newest first
    assert r.request_id == "g"
    adm.on_finished("g")
    (r,) = adm.admit(3.4)  # 1.1 s after it, nobody late: first come, first served again
    assert r.request_id == "e" and adm.num_late_waiting == 0
    adm.on_finished("e")
    adm.check_counts()


def test_without_a_refusal_for_lack_of_time_the_order_stays_first_come_first_served() -> None:
    """The same queue with the deadline off and nobody late yet: arrival order."""
    adm = Admission(AdmissionConfig(newest_first_when_late=True), Knobs(batch_cap=1, bucketing="fifo"))
    adm.use_slo(1000.0)
    _submit(adm, ("a", 0.5, 100, 0), ("b", 0.6, 100, 0), ("c", 0.7, 100, 0))
    (r,) = adm.admit(1.1)
    assert r.request_id == "a"
