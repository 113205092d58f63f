"""The batcher's blocks: admission by free blocks, prefixes shared between requests (those sent
together too), cached blocks outliving their requests until evicted, preemption when blocks run
out, rollback of rejected drafts, and the table changes the workers are sent."""

from __future__ import annotations

from guidespec.protocol import SamplingParams
from guidespec.scheduler.batching import Batcher, ScheduledRow
from guidespec.scheduler.kv_blocks import BlockPool
from guidespec.scheduler.request import Request, Status

SIZE = 4  # positions a block


def _request(rid: str, prompt: list[int], arrival: float = 0.0, **params: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(**params), arrival)


def _batcher(num_blocks: int, max_batch_size: int = 4, budget: int = 64, **kwargs: object) -> Batcher:
    return Batcher(max_batch_size, budget, prefix_caching=True, pool=BlockPool(num_blocks, SIZE), **kwargs)  # type: ignore[arg-type]


def _run(batcher: Batcher, rows: list[ScheduledRow], sampled: int = 7) -> None:
    """What a step does to its rows: their tokens computed, a token sampled where logits came."""
    for row in rows:
        row.request.advance_computed(row.num_new_tokens)
        if row.num_logits:
            row.request.output_token_ids.append(sampled)
    batcher.commit(rows)


SYSTEM = list(range(100, 113))  # 13 tokens: three full blocks and one more token


def test_a_second_request_maps_the_first_ones_blocks_and_computes_the_rest() -> None:
    batcher = _batcher(32)
    first = _request("first", SYSTEM + [1, 2])
    batcher.add(first)
    rows = batcher.schedule()
    assert [(r.start, r.num_new_tokens) for r in rows] == [(0, 15)]
    assert len(first.blocks.blocks) == 4  # type: ignore[union-attr]  # 15 positions
    _run(batcher, rows)
    assert first.blocks.num_full == 3  # type: ignore[union-attr]  # 15 final tokens: blocks 0-2 are full
    second = _request("second", SYSTEM + [3, 4, 5])
    batcher.add(second)
    rows = batcher.schedule()
    assert [(r.request.request_id, r.start, r.num_new_tokens) for r in rows] == [("first", 15, 1), ("second", 12, 4)]
    assert second.stats.num_cached_tokens == 12 and second.num_computed_tokens == 12
    assert second.blocks.blocks[:3] == first.blocks.blocks[:3]  # type: ignore[union-attr]  # the same blocks
    assert all(batcher.pool.ref_counts[b] == 2 for b in first.blocks.blocks[:3])  # type: ignore[union-attr]
    assert (batcher.prefix_cache_queries, batcher.prefix_cache_hits) == (15 + 16, 12)
    # the workers get each changed table once: both now, then none until one changes again
    slots, lengths, blocks = batcher.table_updates(rows)  # type: ignore[misc]
    assert slots.tolist() == [first.slot, second.slot] and lengths.tolist() == [4, 4]
    assert blocks.tolist() == first.blocks.blocks + second.blocks.blocks  # type: ignore[union-attr]
    assert batcher.table_updates(rows) is None


def test_requests_sent_together_wait_for_the_blocks_the_first_computes() -> None:
    batcher = _batcher(64, budget=8)  # the first prompt takes two steps
    requests = [_request(f"r{i}", SYSTEM + [i, i], arrival=i) for i in range(3)]
    for r in requests:
        batcher.add(r)
    rows = batcher.schedule()
    assert [r.request.request_id for r in rows] == ["r0"]  # the others wait for its blocks
    assert requests[1].status is Status.WAITING and requests[1].slot is None
    _run(batcher, rows)
    assert [r.request.request_id for r in batcher.schedule()] == ["r0"]  # its blocks 0-1 only are full yet
    rows = batcher.schedule()
    _run(batcher, [r for r in rows if r.request is requests[0]])
    rows = batcher.schedule()
    assert {r.request.request_id: r.start for r in rows} == {"r0": 15, "r1": 12, "r2": 12}
    assert [r.stats.num_cached_tokens for r in requests] == [0, 12, 12]


def test_cached_blocks_outlive_their_request_until_evicted_least_recent_first() -> None:
    batcher = _batcher(8, max_batch_size=1)
    old = _request("old", list(range(9)))  # blocks 0, 1 full, then one token
    batcher.add(old)
    _run(batcher, batcher.schedule())
    batcher.remove(old)
    assert batcher.pool.num_cached == 2 and batcher.pool.num_free == 8  # cached, yet free to take
    again = _request("again", list(range(9)) + [50])
    batcher.add(again)
    batcher.schedule()
    assert again.stats.num_cached_tokens == 8
    batcher.remove(again)
    big = _request("big", list(range(200, 229)))  # 29 positions: 8 blocks, every cached one evicted
    batcher.add(big)
    assert len(batcher.schedule()) == 1 and batcher.pool.num_evicted == 2 and batcher.pool.num_cached == 0
    batcher.remove(big)
    late = _request("late", list(range(9)))
    batcher.add(late)
    batcher.schedule()
    assert late.stats.num_cached_tokens == 0


def test_out_of_blocks_the_last_request_is_preempted_and_later_recomputed() -> None:
    batcher = _batcher(5, max_batch_size=3)  # 20 positions
    requests = [_request(f"r{i}", list(range(10 * i, 10 * i + 7)), arrival=i) for i in range(3)]
    for r in requests:
        batcher.add(r)
    rows = batcher.schedule()  # two fit (with a block spare for each running request's next step)
    assert [r.request.request_id for r in rows] == ["r0", "r1"] and requests[2].status is Status.WAITING
    _run(batcher, rows)
    _run(batcher, batcher.schedule())  # position 7: still in their second blocks
    rows = batcher.schedule()  # position 8 wants a third block each: one is left
    assert [r.request.request_id for r in rows] == ["r0"]  # r1 came last: it gave its blocks back
    r1 = requests[1]
    assert r1.status is Status.WAITING and batcher.waiting[0] is r1 and r1.num_computed_tokens == 0
    assert r1.blocks is None and r1.slot is None and r1.stats.num_preemptions == 1
    assert r1.output_token_ids == [7, 7]  # its output is kept: computed again with its prompt
    batcher.remove(requests[0])
    rows = batcher.schedule()  # r1 first again; its two full blocks were still cached, not evicted
    assert [(r.request.request_id, r.start, r.num_new_tokens, r.num_logits) for r in rows] == [("r1", 8, 1, 1)]
    assert batcher.num_preemptions == 1 and requests[2].status is Status.WAITING
    batcher.remove(r1)
    assert [(r.request.request_id, r.start) for r in batcher.schedule()] == [("r2", 0)]


def test_rejected_drafts_roll_back_and_only_final_tokens_are_shared() -> None:
    batcher = _batcher(32, lookahead=6)
    r = _request("r", list(range(6)))
    batcher.add(r)
    _run(batcher, batcher.schedule())
    assert r.blocks.capacity >= 6 + 6  # type: ignore[union-attr]  # the lookahead: room for drafts
    # a verify step: the last token and 5 drafts; 1 accepted, then the target's own token
    r.draft_tokens = [60, 61, 62, 63, 64]
    row = ScheduledRow(r, 6, 6, 6)
    r.advance_computed(6 - 5)
    r.output_token_ids += [60, 8]
    r.advance_computed(1)
    batcher.commit([row])
    assert r.num_computed_tokens == 8 and r.blocks.num_full == 2  # type: ignore[union-attr]
    other = _request("other", list(range(6)) + [7, 60, 61, 62])  # the rejected drafts' tokens
    batcher.add(other)
    batcher.schedule()
    assert other.stats.num_cached_tokens == 8  # the two blocks of final tokens, not the drafts' positions


def test_penalized_requests_share_their_blocks_but_map_none() -> None:
    batcher = _batcher(32)
    a = _request("a", SYSTEM + [1])
    batcher.add(a)
    _run(batcher, batcher.schedule())
    penalized = _request("p", SYSTEM + [2], repetition_penalty=1.2)
    batcher.add(penalized)
    batcher.schedule()
    assert penalized.num_computed_tokens == 0 and penalized.stats.num_cached_tokens == 0


def test_a_step_run_ahead_runs_the_token_the_step_before_samples() -> None:
    """Async scheduling: once a step that samples a request's next token has gone out, the next
    step runs that token (LAST_SAMPLED) before its outputs come back; the request's last step
    before ``max_tokens`` is not run ahead, and its blocks hold the pending position."""
    from guidespec.protocol import LAST_SAMPLED

    batcher = _batcher(32)
    r = _request("r", [1, 2, 3, 4, 5], max_tokens=3)
    batcher.add(r)
    first = batcher.schedule()
    assert [(row.start, row.num_new_tokens, row.num_logits) for row in first] == [(0, 5, 1)]
    batcher.started(first, step=1, run_ahead=True)
    assert r.num_computed_tokens == 5 and r.pending_step == 1 and r.num_known_tokens == 6
    ahead = batcher.schedule()  # before step 1's outputs
    assert [(row.start, row.num_new_tokens, row.num_logits) for row in ahead] == [(5, 1, 1)]
    assert r.tokens(5, 6) == [LAST_SAMPLED]
    assert r.blocks is not None and len(r.blocks.blocks) * SIZE >= 6
    batcher.started(ahead, step=2, run_ahead=True)
    assert r.pending_step == 2 and r.num_computed_tokens == 6
    r.output_token_ids.append(9)  # step 1's token comes back: step 2's is pending
    assert r.num_known_tokens == 7 and batcher.schedule()[0].start == 6
    r.output_token_ids.append(9)  # step 2's token back, and step 3 out: it samples the third and last
    r.num_computed_tokens, r.pending_step = 7, 3
    assert batcher.schedule() == []  # (no step runs past max_tokens)


def test_steps_that_do_not_run_ahead_leave_nothing_pending() -> None:
    batcher = _batcher(32)
    r = _request("r", [1, 2, 3], max_tokens=8)
    batcher.add(r)
    rows = batcher.schedule()
    batcher.started(rows, step=1, run_ahead=False)
    assert r.pending_step == -1 and r.num_computed_tokens == 3 and batcher.schedule() == []
