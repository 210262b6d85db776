"""Scheduler.remove of waiting requests in O(1) (lazy deletion), without a model."""

import random

from specserve.config import SchedulerConfig
from specserve.kv_cache.manager import KVCacheManager
from specserve.request import Request, RequestStatus, SamplingParams
from specserve.scheduler.scheduler import Scheduler, WaitingQueue

_PARAMS = SamplingParams(max_tokens=4)


class _CountingRequest(Request):
    """A Request that counts equality tests: a removal that scans a queue makes them."""

    comparisons = 0

    def __eq__(self, other):
        _CountingRequest.comparisons += 1
        return self is other

    __hash__ = Request.__hash__


def _req(rid, tokens=(1, 2, 3), cls=Request):
    return cls(str(rid), list(tokens), _PARAMS, {2}, sampling_seed=0)


def _scheduler(max_num_seqs=64, num_blocks=64, block_size=4):
    return Scheduler(SchedulerConfig(max_num_seqs, 1024), KVCacheManager(num_blocks, block_size), 4096)


def _abort(sched, req):  # as Engine.abort_request: finished first, then removed
    req.status = RequestStatus.FINISHED_ABORTED
    sched.remove(req)


def test_aborting_100k_queued_requests_never_scans_the_queue():
    n = 100_000
    sched = _scheduler()
    reqs = [_req(i, cls=_CountingRequest) for i in range(n)]
    for r in reqs:
        sched.add(r)
    assert sched.num_waiting == len(sched.waiting) == n
    order = reqs[:]
    random.Random(0).shuffle(order)  # a disconnect aborts its requests in no particular order
    _CountingRequest.comparisons = 0
    for i, r in enumerate(order):
        _abort(sched, r)
        if i == n // 2:
            assert sched.num_waiting == n - i - 1
    assert _CountingRequest.comparisons == 0  # every removal went straight to its entry
    assert sched.num_waiting == 0 and not sched.waiting and not sched.has_unfinished()
    assert list(sched.waiting) == []
    # emptied entries do not pile up: swept once they outnumber the live ones
    assert len(sched.waiting._entries) <= WaitingQueue._SWEEP_MIN + 1
    out = sched.schedule()
    assert not out.requests and len(sched.waiting._entries) == 0
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_waiting_queue_skips_removed_requests_and_keeps_order():
    q = WaitingQueue()
    a, b, c, d = (_req(x) for x in "abcd")
    for r in (a, b, c):
        q.append(r)
    assert q.remove(b) and not q.remove(b)  # a second removal is a no-op
    assert len(q) == 2 and b not in q and list(q) == [a, c]
    q.appendleft(d)  # a preempted request goes back to the head
    assert list(q) == [d, a, c]
    assert q.remove(d) and q.peek() is a
    assert q.popleft() is a and q.popleft() is c
    assert not q and q.peek() is None
    q.append(b)  # removed once, queued again: one live entry, at the tail
    assert list(q) == [b] and len(q) == 1


def test_sweep_keeps_live_requests_in_order():
    q = WaitingQueue()
    reqs = [_req(i) for i in range(5000)]
    for r in reqs:
        q.append(r)
    for r in reqs[:4990]:
        q.remove(r)
    assert len(q) == 10 and len(q._entries) <= 2 * 10 + WaitingQueue._SWEEP_MIN
    assert list(q) == reqs[4990:]


def test_schedule_admits_live_requests_in_order_and_counts_them():
    sched = _scheduler(max_num_seqs=3)
    reqs = [_req(i) for i in range(8)]
    for r in reqs:
        sched.add(r)
    for i in (0, 2, 3):
        _abort(sched, reqs[i])
    assert sched.num_waiting == 5
    out = sched.schedule()
    assert out.requests == [reqs[1], reqs[4], reqs[5]]
    assert sched.num_running == 3 and sched.num_waiting == 2
    assert list(sched.waiting) == [reqs[6], reqs[7]]
    _abort(sched, reqs[6])
    _abort(sched, reqs[4])  # a running one
    assert sched.running == [reqs[1], reqs[5]] and sched.num_waiting == 1
    for r in (reqs[1], reqs[5], reqs[7]):
        _abort(sched, r)
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_preempted_request_goes_back_to_the_head_of_waiting():
    sched = _scheduler(max_num_seqs=2, num_blocks=4)  # blocks of 4 tokens
    a, b, c = _req("a", range(4)), _req("b", range(10, 14)), _req("c", range(20, 24))
    for r in (a, b, c):
        sched.add(r)
    assert sched.schedule().requests == [a, b] and list(sched.waiting) == [c]
    for r in (a, b):
        r.num_computed_tokens = 4
    a.all_token_ids += list(range(12))  # a now needs 3 more blocks, 2 are free: b must go
    out = sched.schedule()
    assert out.requests == [a] and out.preempted == [b] and sched.num_preemptions == 1
    assert list(sched.waiting) == [b, c] and sched.num_waiting == 2
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == []
    for r in (c, a, b):
        _abort(sched, r)
    assert not sched.has_unfinished() and sched.num_waiting == 0
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
