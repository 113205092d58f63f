"""Tensor parallelism over torch.distributed (gloo on CPU, nccl on GPU).

How the model is cut: attention by key/value head groups (a rank owns whole groups, so GQA
needs no communication inside attention; groups need not divide evenly: 3 groups on 2 ranks
is 2 + 1), the MLP by intermediate columns, the vocabulary into equal padded shards. Outputs
of row-parallel layers are all-reduced; logits are gathered on rank 0, the only rank that
samples. With one rank every collective is a no-op. CPU ranks that are all on one host (the
plain launcher's) exchange through shared memory (``ipc/collectives.py``), gloo only for what
does not fit its slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from guidespec.ipc.collectives import CollectivesLayout, ShmCollectives

_shm: ShmCollectives | None = None  # this rank's shared-memory collectives, where the launcher made them


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of ``n`` items cut as evenly as possible."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def vocab_shard(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, end, padded shard size) of this rank's vocabulary rows."""
        shard = -(-vocab_size // self.size)
        start = self.rank * shard
        return start, min(start + shard, vocab_size), shard


def init_distributed(
    tp: TPInfo, init_method: str, backend: str = "gloo", shared: CollectivesLayout | None = None
) -> None:
    """Join the ranks' process group; with ``shared`` (CPU ranks on one host) attach its segment,
    which then carries every collective that fits it."""
    global _shm
    if tp.size == 1:
        return
    dist.init_process_group(backend, init_method=init_method, rank=tp.rank, world_size=tp.size)
    if shared is not None:
        _shm = ShmCollectives.attach(shared, tp.rank)


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size > 1:
        if _shm is not None and x.is_contiguous() and _shm.fits(x):
            return _shm.all_reduce(x)
        dist.all_reduce(x)
    return x


def broadcast_ints(values: np.ndarray, tp: TPInfo, device: torch.device) -> np.ndarray:
    """Rank 0's int64 ``values`` on every rank (each passes an array of the same length)."""
    if tp.size == 1:
        return values
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)
    if _shm is not None and _shm.fits(t):  # (CPU ranks only have one)
        return _shm.broadcast(t).numpy()
    dist.broadcast(t, src=0)
    return t.cpu().numpy()


def gather_vocab(local_logits: torch.Tensor, tp: TPInfo, vocab_size: int) -> torch.Tensor | None:
    """[R, shard] on every rank -> [R, vocab] on rank 0 (None elsewhere)."""
    if tp.size == 1:
        return local_logits[:, :vocab_size]
    local_logits = local_logits.contiguous()
    if _shm is not None and _shm.fits(local_logits):
        shards = _shm.gather(local_logits)
        return None if shards is None else torch.cat(shards, dim=-1)[:, :vocab_size]
    parts = [torch.empty_like(local_logits) for _ in range(tp.size)] if tp.is_driver else None
    dist.gather(local_logits, parts, dst=0)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def destroy_distributed() -> None:
    global _shm
    if _shm is not None:
        _shm.close()
        _shm = None
    if dist.is_initialized():
        dist.destroy_process_group()
