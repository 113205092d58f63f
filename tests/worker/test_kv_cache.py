"""The KV cache in blocks: a slot's positions spread over several blocks give every path that
reads or writes the cache (the C kernels, torch's attention, the padded forward of the graphs)
what one block a slot gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guidespec.worker import kernels
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.kv_cache import KVCache


def test_writes_land_in_the_slots_blocks_and_gather_reads_them_back() -> None:
    gen = torch.Generator().manual_seed(0)
    by_slot = KVCache(2, 3, 2, 40, 16, torch.float32)
    paged = KVCache(2, 3, 2, 40, 16, torch.float32, block_size=8)
    assert paged.blocks_per_slot == 5 and paged.k[0].shape == (2, 15, 8, 16)
    slots = torch.tensor([2, 0, 2, 1, 1])
    positions = torch.tensor([39, 0, 8, 17, 3])
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    for cache in (by_slot, paged):
        cache.write(1, slots, positions, k, v)
    for rows in ([0, 1, 2], [2, 1]):
        for want, got in zip(by_slot.gather(1, rows, 40), paged.gather(1, rows, 40)):
            assert torch.equal(want, got)
    tables = paged.block_tables(torch.tensor([2, 0], dtype=torch.int32))
    assert tables.tolist() == [[10, 11, 12, 13, 14], [0, 1, 2, 3, 4]]
    rows = paged.cache_rows(slots, positions)
    assert torch.equal(paged.k[1][:, rows // 8, rows % 8].transpose(0, 1), k)  # block * 8 + offset
    with pytest.raises(ValueError):
        KVCache(1, 1, 1, 40, 16, torch.float32, block_size=12)


def test_a_pool_follows_the_tables_the_scheduler_sets() -> None:
    """With a pool, slots read and write the blocks their tables list (two slots may list the same
    block: a shared prefix); entries past a table's end point at the scratch block."""
    gen = torch.Generator().manual_seed(1)
    pool = KVCache(1, 3, 2, 32, 4, torch.float32, block_size=8, num_blocks=6)
    assert pool.k[0].shape == (2, 7, 8, 4) and pool.scratch_block == 6
    assert pool.block_tables(torch.tensor([1], dtype=torch.int32)).tolist() == [[6, 6, 6, 6]]
    pool.set_tables(np.array([0, 2], np.int32), np.array([2, 3], np.int32), np.array([4, 1, 4, 0, 5], np.int32))
    assert pool.block_tables(torch.tensor([2, 0], dtype=torch.int32)).tolist() == [[4, 0, 5, 6], [4, 1, 6, 6]]
    k, v = torch.randn(16, 2, 4, generator=gen), torch.randn(16, 2, 4, generator=gen)
    pool.write(0, torch.zeros(16, dtype=torch.long), torch.arange(16), k, v)  # slot 0: blocks 4 and 1
    keys, values = pool.gather(0, [2], 8)  # slot 2 shares block 4: its first 8 positions
    assert torch.equal(keys[0].transpose(0, 1), k[:8]) and torch.equal(values[0].transpose(0, 1), v[:8])
    assert torch.equal(pool.k[0][:, 1].transpose(0, 1), k[8:])
    pool.set_tables(np.array([0], np.int32), np.array([1], np.int32), np.array([3], np.int32))  # shrunk, moved
    assert pool.block_tables(torch.tensor([0], dtype=torch.int32)).tolist() == [[3, 6, 6, 6]]
    with pytest.raises(RuntimeError):
        KVCache(1, 3, 2, 32, 4, torch.float32, block_size=8).set_tables(
            np.array([0], np.int32), np.array([1], np.int32), np.array([0], np.int32)
        )


def test_block_table_changes_of_few_slots_and_of_many_write_the_same_tables() -> None:
    """``set_tables`` writes a few slots' changes slot by slot and many in one indexed write: over
    random changes of 1-20 slots (lengths 0 up to a whole table), each slot's table is its blocks
    then the scratch block, the others as they were; a slot named twice, lengths that do not add
    up to the blocks given, or a negative length are refused either way."""
    rng = np.random.default_rng(3)
    pool = KVCache(1, 24, 1, 64, 4, torch.float32, block_size=8, num_blocks=100)
    want = np.full((24, 8), 100, dtype=np.int32)
    for _ in range(200):
        slots = rng.choice(24, rng.integers(1, 21), replace=False).astype(np.int32)
        lengths = rng.integers(0, 9, len(slots)).astype(np.int32)
        blocks = rng.integers(0, 100, int(lengths.sum())).astype(np.int32)
        pool.set_tables(slots, lengths, blocks)
        start = 0
        for slot, length in zip(slots.tolist(), lengths.tolist()):
            want[slot] = 100
            want[slot, :length] = blocks[start : start + length]
            start += length
        assert np.array_equal(pool.block_tables(torch.arange(24, dtype=torch.int32)).numpy(), want)
    for count in (2, 12):  # (the slot-by-slot path, then the indexed one)
        slots = np.arange(count, dtype=np.int32)
        for bad_slots, bad_lengths, bad_blocks in (
            (np.r_[slots[:-1], 0].astype(np.int32), np.ones(count, np.int32), np.zeros(count, np.int32)),
            (slots, np.ones(count, np.int32), np.zeros(count + 1, np.int32)),
            (slots, np.r_[-1, np.full(count - 1, 1)].astype(np.int32), np.zeros(count - 2, np.int32)),
        ):
            with pytest.raises(ValueError):
                pool.set_tables(bad_slots, bad_lengths, bad_blocks)


@pytest.mark.parametrize("kernels_on", [True, False])
def test_a_forward_over_blocks_of_16_equals_one_over_a_block_a_slot(
    real_model_dir, monkeypatch: pytest.MonkeyPatch, kernels_on: bool
) -> None:  # type: ignore[no-untyped-def]
    """Prefill, decode and verify steps of two rows, and the padded forward the graphs capture:
    the same hidden states bit for bit with the cache in blocks of 16 (C kernels, or torch where
    the kernels are off)."""
    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config
    from guidespec.worker.model import LlamaModel
    from guidespec.worker.tp import TPInfo

    if not kernels_on:
        monkeypatch.setattr(kernels.loader, "library", lambda: None)
    hf = load_hf_config(real_model_dir)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 256, quantized=True)
    model.load(real_model_dir, hf, show_progress=False)
    results = []
    for block_size in (None, 16):
        if block_size is None:
            kv = model.create_kv_cache(3)
        else:  # a pool, each slot's blocks scattered through it
            kv = model.create_kv_cache(3, block_size, num_blocks=64)
            tables = np.random.default_rng(0).permutation(64)[:48].astype(np.int32)
            kv.set_tables(np.array([0, 1, 2], np.int32), np.array([16, 16, 16], np.int32), tables)
        assert kv.block_size == (block_size or 256)
        outs = [model.forward(ForwardBatch.create(np.arange(70) % 700, [0, 2], [0, 0], [37, 33], [1, 1]), kv)]
        outs.append(model.forward(ForwardBatch.create([5, 6], [0, 2], [37, 33], [1, 1], [1, 1]), kv))
        outs.append(model.forward(ForwardBatch.create(np.arange(8) + 9, [0, 2], [38, 34], [4, 4], [4, 4]), kv))
        outs.append(
            model.forward_padded(
                kv,
                torch.tensor([1, 2, 3, 4, 5, 6]),
                torch.tensor([42, 43, 44, 38, 39, 40]),
                torch.tensor([0, 0, 0, 2, 2, 2]),
                torch.tensor([0, 2]),
                3,
                64,
            )
        )
        results.append(outs)
    for by_slot, paged in zip(*results):
        assert torch.equal(by_slot, paged)
