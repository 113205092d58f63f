"""Shared-memory collectives between rank processes: what gloo's give, bit for bit, and a dead
rank ends its peers' wait."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from guidespec.ipc.collectives import CollectivesLayout, RankDied, ShmCollectives

SLOT = 1 << 16


def _inputs(rank: int) -> list[torch.Tensor]:
    """Each collective's input on ``rank``: dtypes, shapes and sizes up to a whole slot."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(5, 576, generator=g),  # (a decode step's hidden states)
        torch.randn(3, 7, generator=g).to(torch.bfloat16),
        torch.randn(SLOT // 4, generator=g),  # a whole slot
        torch.randn(1, generator=g).to(torch.float16),
    ]


def _rank(layout: CollectivesLayout, rank: int, init: str, rounds: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=layout.num_ranks)
    shm = ShmCollectives.attach(layout, rank)
    sums: list[tuple[bool, bool, str]] = []  # (equal to gloo's, close to it, the bits' digest)
    exact: list[bool] = []  # gathers and broadcasts
    for _ in range(rounds):  # (many rounds: both buffers, each written again)
        for x in _inputs(rank):
            ours, theirs = shm.all_reduce(x.clone()), x.clone()
            dist.all_reduce(theirs)
            digest = hashlib.sha1(ours.view(torch.uint8).numpy().tobytes()).hexdigest()
            sums.append((torch.equal(ours, theirs), torch.allclose(ours.float(), theirs.float(), atol=0.05), digest))
        x = _inputs(rank)[0]
        gathered = shm.gather(x)
        parts = [torch.empty_like(x) for _ in range(layout.num_ranks)] if rank == 0 else None
        dist.gather(x, parts, dst=0)
        exact.append(gathered is None if rank else all(torch.equal(a, b) for a, b in zip(gathered, parts)))
        tokens = torch.arange(9, dtype=torch.int64) * (7 if rank == 0 else -1)
        exact.append(torch.equal(shm.broadcast(tokens), torch.arange(9, dtype=torch.int64) * 7))
    shm.close()
    dist.destroy_process_group()
    out.put((rank, sums, exact))


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_collectives_equal_gloos_on_every_rank(num_ranks: int) -> None:
    """All-reduce (fp32, bf16, fp16, a whole slot), gather to rank 0 and broadcast from it, many
    times over, give what gloo's give; with 2 ranks the sums are gloo's bits (a + b in either
    order), with 3 every rank holds the same bits."""
    layout = CollectivesLayout(f"guidespec-{uuid.uuid4().hex[:12]}-tp", num_ranks, SLOT)
    owner = ShmCollectives.create(layout)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{Path(os.environ.get('TMPDIR', '/tmp')) / uuid.uuid4().hex}"
    procs = [ctx.Process(target=_rank, args=(layout, r, init, 5, out)) for r in range(num_ranks)]
    try:
        for p in procs:
            p.start()
        results = {rank: (sums, exact) for rank, sums, exact in (out.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
        owner.close()
    assert sorted(results) == list(range(num_ranks))
    assert all(len(exact) == 10 and all(exact) for _, exact in results.values())
    sums = [s for s, _ in results.values()]
    assert all(len(s) == 20 and all(close for _, close, _ in s) for s in sums)
    assert all([digest for *_, digest in s] == [digest for *_, digest in sums[0]] for s in sums)  # every rank's bits
    if num_ranks == 2:  # (gloo may add three in another order)
        assert all(equal for s in sums for equal, _, _ in s)
    assert not Path(f"/dev/shm/{layout.name}").exists()


def _waiter(layout: CollectivesLayout, out: Any) -> None:
    shm = ShmCollectives.attach(layout, 0)
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(4))
    except RankDied as e:
        out.put(("died", str(e), time.monotonic() - start))
    else:
        out.put(("returned", "", 0.0))


def _sleeper(layout: CollectivesLayout) -> None:
    ShmCollectives.attach(layout, 1)
    time.sleep(60)


def test_a_dead_rank_ends_its_peers_wait() -> None:
    """A rank killed before its part of a collective: the rank waiting for it raises within a
    fraction of a second, naming it (a step never hangs on a dead peer)."""
    layout = CollectivesLayout(f"guidespec-{uuid.uuid4().hex[:12]}-tp", 2, SLOT)
    owner = ShmCollectives.create(layout)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    sleeper = ctx.Process(target=_sleeper, args=(layout,))
    sleeper.start()
    try:
        deadline = time.monotonic() + 60
        while owner._pids[1] == 0 and time.monotonic() < deadline:  # (attached: its pid is in the header)
            time.sleep(0.05)
        waiter = ctx.Process(target=_waiter, args=(layout, out))
        waiter.start()
        time.sleep(1.0)
        assert out.empty()  # still waiting for rank 1
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.join(timeout=10)
        kind, message, _ = out.get(timeout=30)
        waiter.join(timeout=10)
    finally:
        for p in (sleeper,):
            if p.is_alive():
                p.kill()
        owner.close()
    assert kind == "died" and "rank 1" in message and str(sleeper.pid) in message
