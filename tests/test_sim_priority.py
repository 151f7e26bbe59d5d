"""SimEngine's ``scheduling_policy``: ``fcfs`` exactly as before, ``priority`` deciding as vLLM
0.32's V1 scheduler does (``vllm/v1/core/sched/request_queue.py`` ``PriorityRequestQueue``:
waiting requests by (priority, arrival_time); ``scheduler.py``'s running loop: on a KV shortage
the victim is ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``, a request
already scheduled in the step included, where fcfs pops ``self.running[-1]``)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from test_sim_engine import create_engine, run_all

from batchpilot.core.engine import Request
from batchpilot.envs.sim_engine import SimEngine
from batchpilot.schemas.engine import SimEngineConfig


def _mixed_workload(seed: int = 7, n: int = 400, rate: float = 40.0) -> list[Request]:
    """Poisson arrivals, three priorities, some shared prefixes: with 1,500 KV blocks the
    engine preempts a few hundred times (the slow path runs)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = np.clip(rng.lognormal(np.log(900), 0.7, n), 1, 6000).astype(int)
    o = np.clip(rng.lognormal(np.log(200), 0.7, n), 1, 1500).astype(int)
    pr = rng.integers(0, 3, n)
    hashes = [tuple(range(int(k))) if k else () for k in rng.integers(0, 3, n)]
    return [Request(f"w{i}", float(t[i]), int(p[i]), int(o[i]), int(pr[i]), prefix_hashes=hashes[i])
            for i in range(n)]


def _episode(**cfg: Any) -> tuple[str, int, list[Any], SimEngine]:
    """The workload fed at its arrival times (``advance_until``, as the environment does), then
    drained; a digest of every request's first-token and finish time (to the microsecond) and
    preemptions, the engine's preemption count, the finished requests and the engine."""
    e = create_engine(num_gpu_blocks_override=1500, max_num_batched_tokens=2048, **cfg)
    fin: list[Any] = []
    for r in _mixed_workload():
        fin += e.advance_until(r.arrival_time).finished
        e.add_request(r)
    while e.num_running or e.num_waiting:
        fin += e.step().finished
    rows = [(f.request_id, round(f.first_token_time, 6), round(f.finish_time, 6), f.num_preemptions) for f in fin]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16], e.stats().num_preemptions, fin, e


@pytest.mark.parametrize("cfg", [{}, {"scheduling_policy": "fcfs"}])
def test_fcfs_episode_is_the_one_before_the_option(cfg: dict[str, Any]) -> None:
    """Digest recorded with the engine as it was before ``scheduling_policy`` existed."""
    digest, preemptions, fin, _ = _episode(**cfg)
    assert (digest, preemptions, len(fin)) == ("fb4f096384308101", 288, 400)


def test_priority_episode_serves_the_smaller_numbers_first_and_keeps_the_books() -> None:
    """The same episode under ``priority``: every request finishes, the KV pool is whole again
    (undoing a scheduled victim's blocks loses none), and the classes' waits are ordered."""
    _, preemptions, fin, e = _episode(scheduling_policy="priority")
    assert len(fin) == 400 and preemptions > 0
    st = e.stats()
    assert st.num_kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
    wait = {p: np.mean([f.first_token_time - f.arrival_time for f in fin if f.priority == p]) for p in (0, 1, 2)}
    assert wait[0] < wait[1] < wait[2], wait


def _order_served(policy: str) -> list[str]:
    """Four requests queued at once, one running at a time: the order they finish in."""
    e = create_engine(scheduling_policy=policy)
    e.set_max_active(1)
    for rid, prio in (("a", 2), ("b", 1), ("c", 1), ("d", 0)):
        e.add_request(Request(rid, 0.0, 64, 4, prio))
    return [f.request_id for f in run_all(e).finished]


def test_waiting_order_is_vllms() -> None:
    """fcfs: arrival order. priority: (priority, arrival), as ``PriorityRequestQueue`` pops."""
    assert _order_served("fcfs") == ["a", "b", "c", "d"]
    assert _order_served("priority") == ["d", "b", "c", "a"]


def _preempted_on_shortage(policy: str, priorities: tuple[int, int, int]) -> tuple[list[str], int, SimEngine]:
    """Three 16-token prompts on a 4-block cache (16-token blocks): all three are admitted in
    one step (a block each, in waiting-queue order); in the next every one needs its second
    block, one is free, so the running loop must preempt. Returns the requests preempted in
    that step, the decode tokens it ran, and the engine."""
    e = create_engine(scheduling_policy=policy, block_size=16, num_gpu_blocks_override=4)
    for rid, prio in zip("xyz", priorities):
        e.add_request(Request(rid, 0.0, 16, 10, prio))
    first = e.step()
    assert len(first.first_tokens) == 3 and e.stats().num_kv_blocks_used == 3
    second = e.step()
    return list(second.preempted), second.num_decode_tokens, e


def _drains_whole(e: SimEngine, left: list[str], out: int) -> None:
    """The rest runs to the end, every request once with all its tokens, and no KV block is
    lost or invented."""
    done = run_all(e).finished
    assert sorted(f.request_id for f in done) == sorted(left)
    assert all(f.output_len == out for f in done)
    st = e.stats()
    assert st.num_kv_blocks_used == 0 and e._free + len(e._evictable) * e._bph == st.num_kv_blocks_total


@pytest.mark.parametrize("priorities", [(1, 2, 1), (2, 1, 1)])
def test_fcfs_preempts_the_last_admitted(priorities: tuple[int, int, int]) -> None:
    got, decoded, e = _preempted_on_shortage("fcfs", priorities)
    assert (got, decoded) == (["z"], 2)  # x and y decode with the block z gave back
    _drains_whole(e, ["x", "y", "z"], 10)


def test_priority_preempts_the_largest_priority_then_the_latest_arrival() -> None:
    # Admitted x, z, y (the heap's order); x takes the free block, z needs one and the victim
    # is y (priority 2), whose block z takes.
    got, decoded, e = _preempted_on_shortage("priority", (1, 2, 1))
    assert (got, decoded, e.stats().num_kv_blocks_used) == (["y"], 2, 4)
    _drains_whole(e, ["x", "y", "z"], 10)
    # Equal priorities: the latest arrival, as fcfs would pick here.
    got, decoded, e = _preempted_on_shortage("priority", (1, 1, 1))
    assert (got, decoded) == (["z"], 2)
    _drains_whole(e, ["x", "y", "z"], 10)


@pytest.mark.parametrize("policy, want", [("fcfs", (["z"], 2, 4)), ("priority", (["x"], 2, 4))])
def test_a_victim_scheduled_earlier_in_the_step_gives_back_its_budget_and_blocks(
        policy: str, want: tuple[list[str], int, int]) -> None:
    """x (priority 2) runs alone first, y and z (priority 1) join a step later. Two steps on,
    y and z need their second block, none is free: x, scheduled first in the step (it needs
    no block), is the priority victim; its token and its two blocks come back and y and z
    decode. fcfs preempts z, the last admitted."""
    e = create_engine(scheduling_policy=policy, block_size=16, num_gpu_blocks_override=4)
    e.add_request(Request("x", 0.0, 16, 10, 2))
    e.step()
    for rid in "yz":
        e.add_request(Request(rid, e.now, 16, 10, 1))
    e.step()
    assert e.stats().num_kv_blocks_used == 4
    r = e.step()
    assert (list(r.preempted), r.num_decode_tokens, e.stats().num_kv_blocks_used) == want
    _drains_whole(e, ["x", "y", "z"], 10)


@pytest.mark.parametrize("policy, want", [("fcfs", (["z"], 2, 6)), ("priority", (["y"], 1, 5))])
def test_the_running_loop_stops_at_a_request_that_preempts_itself(
        policy: str, want: tuple[list[str], int, int]) -> None:
    """Running x (1), y (2), z (1) in that order, all needing a block in the same step with
    one free. fcfs: x takes it, y preempts z and decodes. priority: x takes it, y is the
    largest key and preempts itself, and vLLM's loop breaks there: z decodes nothing this step
    (one decode token in all) and takes its block in the next one."""
    e = create_engine(scheduling_policy=policy, block_size=16, num_gpu_blocks_override=7)
    e.add_request(Request("x", 0.0, 16, 30, 1))
    e.add_request(Request("y", 0.0, 16, 30, 2))
    e.step()  # x, y: 16 tokens, a block each; their next block at iteration 17
    e.add_request(Request("z", e.now, 17, 30, 1))  # 17 tokens: its next block at iteration 17 too
    e.step()
    assert e.stats().num_kv_blocks_used == 6 and [s.rid for s in e._running.values()] == ["x", "y", "z"]
    for _ in range(15):  # iterations 2-16: nobody needs a block
        assert not e.step().preempted
    r = e.step()
    assert (list(r.preempted), r.num_decode_tokens, e.stats().num_kv_blocks_used) == want
    if policy == "priority":
        assert e.step().num_decode_tokens == 2 and e.stats().num_kv_blocks_used == 6  # z's block now
    _drains_whole(e, ["x", "y", "z"], 30)


def test_a_preempted_request_goes_back_by_its_key_not_to_the_front() -> None:
    """fcfs prepends a victim; priority pushes it by (priority, arrival): a priority-0 request
    waiting behind it is admitted first once blocks free."""
    e = create_engine(scheduling_policy="priority", block_size=16, num_gpu_blocks_override=4)
    for rid, prio in zip("xyz", (2, 1, 1)):
        e.add_request(Request(rid, 0.0, 16, 10, prio))
    e.step()
    e.add_request(Request("core", e.now, 16, 10, 0))
    assert e.step().preempted == ["x"]
    assert e._waiting[0].rid == "core"  # then x


def test_an_unknown_policy_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"engine.scheduling_policy='lifo' is invalid: use one of \('fcfs', 'priority'\)"):
        SimEngineConfig(scheduling_policy="lifo")


@pytest.mark.live
@pytest.mark.timeout(300)
def test_the_waiting_order_is_what_vllms_own_priority_queue_pops() -> None:
    """vLLM's ``PriorityRequestQueue`` with ``Request.__lt__`` (the installed vLLM's code, on
    stand-ins carrying the three fields it compares) pops the hand-built case in the order the
    simulator serves it."""
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue
    from vllm.v1.request import Request as VllmRequest

    class Stand:
        __lt__ = VllmRequest.__lt__

        def __init__(self, rid: str, priority: int, arrival_time: float) -> None:
            self.request_id, self.priority, self.arrival_time = rid, priority, arrival_time

    q = PriorityRequestQueue()
    for t, (rid, prio) in enumerate((("a", 2), ("b", 1), ("c", 1), ("d", 0))):
        q.add_request(Stand(rid, prio, float(t)))  # type: ignore[arg-type]
    assert [q.pop_request().request_id for _ in range(4)] == _order_served("priority")


# --- the same hand-built cases on vLLM's own scheduler (in-process, tiny model) -----------------

def _steps(e: Any, limit: int = 400) -> tuple[list[tuple[int, list[str], int]], list[str]]:
    """Step ``e`` until idle: (step index, ids preempted, output tokens of the step) for each
    step that preempted, and the finish order."""
    pre: list[tuple[int, list[str], int]] = []
    done: list[str] = []
    for k in range(limit):
        r = e.step()
        if r.preempted:
            pre.append((k, sorted(r.preempted), r.num_output_tokens))
        done += [f.request_id for f in r.finished]
        st = e.stats()
        if not (st.num_running or st.num_waiting) and r.num_iterations == 0:
            break
    return pre, done


def _together(e: Any, bs: int, priorities: tuple[int, ...]) -> tuple[Any, ...]:
    """Three one-block prompts at once; all need their second block in the same step."""
    for rid, prio in zip("xyz", priorities):
        e.add_request(Request(rid, e.now, bs, 10, prio))
    return _steps(e)


def _late_low(e: Any, bs: int) -> tuple[Any, ...]:
    """x (priority 2) first and alone, y and z (priority 1) a step later."""
    e.add_request(Request("x", e.now, bs, 10, 2))
    assert _steps(e, 1) == ([], [])
    for rid in "yz":
        e.add_request(Request(rid, e.now, bs, 10, 1))
    return _steps(e)


def _self_preempting(e: Any, bs: int) -> tuple[Any, ...]:
    """x (1), y (2) then z (1, one token more): all three need a block at iteration bs + 1."""
    e.add_request(Request("x", e.now, bs, bs + 8, 1))
    e.add_request(Request("y", e.now, bs, bs + 8, 2))
    assert _steps(e, 1) == ([], [])
    e.add_request(Request("z", e.now, bs + 1, bs + 8, 1))
    return _steps(e)


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllms_scheduler_decides_the_hand_built_cases_as_the_simulator(tiny_model_path: Any) -> None:
    """vLLM 0.32 in-process (``VLLMEngine``, ``--scheduling-policy priority``, 32-token blocks,
    prefix caching off) and the simulator with the same limits (one block less: vLLM keeps a
    null block) preempt the same requests in the same steps and finish them in the same order,
    on the cases above scaled to 32-token blocks."""
    from batchpilot.envs.vllm_engine import VLLMEngine
    from batchpilot.schemas.engine import VLLMEngineConfig

    bs = 32

    def sim(blocks: int) -> SimEngine:
        return create_engine("cpu_tiny", "tiny_llama", scheduling_policy="priority", block_size=bs,
                             num_gpu_blocks_override=blocks, enable_prefix_caching=False, max_num_seqs=8,
                             max_num_batched_tokens=2048)

    cases = [(4, lambda e: _together(e, bs, (1, 2, 1))), (4, lambda e: _together(e, bs, (1, 1, 1))),
             (4, lambda e: _late_low(e, bs)), (7, lambda e: _self_preempting(e, bs))]
    live = VLLMEngine(VLLMEngineConfig(model=str(tiny_model_path), max_model_len=128, block_size=bs,
                                       num_gpu_blocks_override=5, enable_prefix_caching=False, max_num_seqs=8,
                                       max_num_batched_tokens=2048, scheduling_policy="priority"))
    try:
        blocks = 4
        for n, case in cases:
            if n != blocks:
                live.restart(num_gpu_blocks_override=n + 1)
                blocks = n
            assert live.stats().num_kv_blocks_total == n
            want, got = case(sim(n)), case(live)
            print(f"{n} blocks: simulator {want}, vLLM {got}")
            assert want[0] and got == want  # each case preempts
    finally:
        live.close()
