"""One token's forward over a KV cache in blocks of different sizes (issue 47's choice of the CPU's
default block size): the default model with its GGUF blocks, in process, 2 threads.

    python benchmarks/kv_blocks.py [--context 600] [--rounds 8] [--block-sizes 16 64 128]

For each layout (one block a sequence, then a pool of blocks of each size, a sequence's blocks
consecutive in the pool) the median ms of a 1-token forward at ``--context`` positions, and of one
layer's attention alone (``kernels.cache_attention``, its cache warm), the layouts interleaved
round after round (this host drifts).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from guidespec.config import ModelConfig
from guidespec.model_files import load_hf_config, resolve_model_dir
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.kernels import cache_attention
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128])
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = resolve_model_dir(None, show_progress=False)
    hf = load_hf_config(model_dir)
    max_len = 2048
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, max_len, quantized=True)
    model.load(model_dir, hf, show_progress=False)
    caches = {"one block a sequence": model.create_kv_cache(2)}
    for size in args.block_sizes:
        kv = model.create_kv_cache(2, size, num_blocks=2 * max_len // size)
        n = max_len // size
        kv.set_tables(np.array([0], np.int32), np.array([n], np.int32), np.arange(n, dtype=np.int32))
        caches[f"blocks of {size}"] = kv
    for kv in caches.values():
        model.forward(ForwardBatch.create(np.arange(args.context) % 700, [0], [0], [args.context], [1]), kv)
    forward: dict[str, list[float]] = {name: [] for name in caches}
    attention: dict[str, list[float]] = {name: [] for name in caches}
    q = torch.randn(1, model.num_local_heads, model.cfg.head_dim)
    starts = torch.tensor([args.context], dtype=torch.int32)
    for _ in range(args.rounds):
        for name, kv in caches.items():
            times = []
            for _ in range(20):
                batch = ForwardBatch.create([5], [0], [args.context], [1], [1])
                start = time.perf_counter()
                model.forward(batch, kv)
                times.append(time.perf_counter() - start)
            forward[name].append(float(np.median(times)))
            tables = kv.block_tables(torch.tensor([0], dtype=torch.int32))
            start = time.perf_counter()
            for _ in range(200):
                cache_attention(q, kv.k[3], kv.v[3], tables, starts, 1, model.cfg.num_query_groups)
            attention[name].append((time.perf_counter() - start) / 200)
    print(f"| KV layout, {args.context} positions | forward ms | one layer's attention µs |")
    print("|---|---:|---:|")
    for name in caches:
        print(f"| {name} | {np.median(forward[name]) * 1e3:.2f} | {np.median(attention[name]) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
