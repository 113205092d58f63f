"""The scheduler's KV blocks: allocation, sharing of full blocks by content, eviction of cached
blocks least recently released first, rollback, and the pool's books under random use."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guidespec.scheduler.kv_blocks import BlockPool, BlockTable, NoFreeBlocks, block_key


def _check_books(pool: BlockPool, tables: list[BlockTable]) -> None:
    """Every block is free, held (as often as tables list it) or cached, and keys map both ways."""
    held = np.zeros(pool.num_blocks, dtype=np.int32)
    for table in tables:
        for block in table.blocks:
            held[block] += 1
    assert np.array_equal(held, pool.ref_counts)
    free, evictable = set(pool._free), set(pool._evictable)
    assert len(free) == len(pool._free) and not free & evictable
    assert all(held[b] == 0 and pool.keys[b] is None for b in free)
    assert all(held[b] == 0 and pool.keys[b] is not None for b in evictable)
    assert free | evictable | {b for b in range(pool.num_blocks) if held[b]} == set(range(pool.num_blocks))
    assert all(pool.keys[b] == k for k, b in pool.by_key.items())


def test_blocks_are_allocated_until_none_is_left_and_come_back_when_released() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    first = pool.allocate(3)
    assert sorted(first) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.release(first)
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.release(first)


def test_a_prompt_maps_the_full_blocks_another_computed_and_computes_only_the_rest() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    system = list(range(100, 110))  # 10 tokens: 2 full blocks and 2 tokens
    a, b = BlockTable(pool), BlockTable(pool)
    prompt_a = system + [1, 2, 3]
    assert a.map_prefix(prompt_a) == 0
    a.grow(len(prompt_a))
    a.commit(prompt_a, num_final=len(prompt_a))  # its prefill ran: 3 full blocks
    assert a.num_full == 3
    prompt_b = system + [7, 8, 9, 10, 11]
    cached = b.map_prefix(prompt_b)
    assert cached == 8 and b.blocks == a.blocks[:2]  # the two blocks of the shared system prompt
    assert all(pool.ref_counts[block] == 2 for block in a.blocks[:2])
    b.grow(len(prompt_b))
    assert len(b.blocks) == 4 and not set(b.blocks[2:]) & set(a.blocks)
    _check_books(pool, [a, b])


def test_at_least_one_token_is_left_to_compute() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    a = BlockTable(pool)
    prompt = list(range(8))  # exactly two blocks
    a.grow(8)
    a.commit(prompt, 8)
    again = BlockTable(pool)
    assert again.map_prefix(prompt) == 4  # the last block is computed again: its last token gives the logits


def test_released_full_blocks_stay_cached_until_an_allocation_evicts_the_least_recent() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    old, new = BlockTable(pool), BlockTable(pool)
    for table, prompt in ((old, [1, 2, 3, 4]), (new, [5, 6, 7, 8])):
        table.grow(4)
        table.commit(prompt, 4)
    old.release()
    new.release()  # released later: evicted later
    assert pool.num_free == 4 and pool.num_cached == 4
    taken = pool.allocate(2)
    assert pool.num_evicted == 2 and pool.num_cached == 2
    assert BlockTable(pool).map_prefix([1, 2, 3, 4, 0]) == 0  # the older prompt's blocks are gone
    probe = BlockTable(pool)
    assert probe.map_prefix([5, 6, 7, 8, 0]) == 4 and len(set(probe.blocks) & set(taken)) == 0


def test_a_rollback_releases_the_blocks_past_the_kept_tokens_but_never_full_ones() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    table = BlockTable(pool)
    tokens = list(range(20))
    table.grow(9)  # 9 tokens computed ...
    table.commit(tokens, 9)
    table.grow(13)  # ... and 4 drafts written
    assert len(table.blocks) == 4 and table.num_full == 2
    table.truncate(10)  # one draft accepted: positions 0-9 kept
    assert len(table.blocks) == 3 and pool.num_free == 5
    table.truncate(2)  # below the full blocks: they stay
    assert len(table.blocks) == 2
    _check_books(pool, [table])


def test_two_requests_computing_the_same_block_at_once_keep_one_copy() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b = BlockTable(pool), BlockTable(pool)
    prompt = [9, 8, 7, 6, 5]
    for table in (a, b):  # both admitted before either computed: neither found the other's block
        assert table.map_prefix(prompt) == 0
        table.grow(len(prompt))
    a.commit(prompt, 5)
    mine = b.blocks[0]
    b.commit(prompt, 5)
    assert b.blocks[0] == a.blocks[0] and pool.ref_counts[a.blocks[0]] == 2
    assert pool.ref_counts[mine] == 0 and mine in pool._free
    _check_books(pool, [a, b])


def test_a_block_key_names_its_tokens_and_everything_before_them() -> None:
    first = block_key(None, [1, 2])
    assert block_key(None, [1, 2]) == first and block_key(None, [2, 1]) != first
    assert block_key(first, [3, 4]) != block_key(block_key(None, [0, 2]), [3, 4])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "step", "rollback", "finish"]), st.integers(0, 5), st.integers(0, 40)),
        max_size=60,
    )
)
def test_the_books_balance_under_any_sequence_of_requests(ops: list[tuple[str, int, int]]) -> None:
    """Requests drawn from a few shared prefixes are admitted, stepped (tokens made final, blocks
    committed), rolled back and finished in any order; the pool's books always balance, and what a
    request maps from the cache is always its own tokens' blocks."""
    pool = BlockPool(num_blocks=24, block_size=4)
    prefixes = [list(range(p * 100, p * 100 + 13)) for p in range(3)]
    live: dict[int, tuple[BlockTable, list[int], int]] = {}  # id -> (table, tokens, final)
    next_id = 0
    for op, which, amount in ops:
        if op == "admit":
            tokens = prefixes[which % 3] + [which, amount]
            table = BlockTable(pool)
            cached = table.map_prefix(tokens)
            assert cached % 4 == 0 and cached < len(tokens)
            for i, block in enumerate(table.blocks):  # the cache gave blocks holding these very tokens
                assert pool.keys[block] == _key_of(tokens, i + 1, 4)
            try:
                table.grow(len(tokens))
            except NoFreeBlocks:
                table.release()
                continue
            live[next_id] = (table, tokens, cached)
            next_id += 1
        elif live:
            key = sorted(live)[which % len(live)]
            table, tokens, final = live[key]
            if op == "step":
                tokens = tokens + [amount]
                try:
                    table.grow(len(tokens))
                except NoFreeBlocks:
                    continue
                final = len(tokens)
                table.commit(tokens, final)
                live[key] = (table, tokens, final)
            elif op == "rollback":
                kept = max(final, len(tokens) - amount % 3)
                table.truncate(kept)
            else:
                table.release()
                del live[key]
        _check_books(pool, [t for t, _, _ in live.values()])


def _key_of(tokens: list[int], num_blocks: int, size: int) -> bytes | None:
    key = None
    for i in range(num_blocks):
        key = block_key(key, tokens[i * size : (i + 1) * size])
    return key
