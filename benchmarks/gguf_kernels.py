"""The GGUF kernel's formats side by side on one weight shape: ms per product of M activation
rows (``kernels.linear``), each format's random blocks against the fp32 packed kernel.

    python benchmarks/gguf_kernels.py [--n 2048] [--k 640] [--rows 1 16] [--threads 1] [--cpu-time]

The K-quants come in 256 inputs: their weight is cut to K columns from the next multiple of 256
(as tensor parallelism cuts them; the kernel's blocks are 32 inputs). Each figure is the fastest
of ``--repeats`` calls, the formats alternating round by round, as other work shares the cores;
``--cpu-time`` times with this process's CPU time (use with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402

FORMATS = ["Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"]


def weights(n: int, k: int) -> dict[str, object]:
    """Each format's weight [n, k] (random blocks, sane scales), and fp32 packed."""
    import gguf

    from guidespec.worker import kernels
    from guidespec.worker.kernels.gguf_weights import from_gguf

    rng = np.random.default_rng(0)
    out: dict[str, object] = {"fp32": kernels.pack(torch.randn(n, k) * 0.05)}
    for name in FORMATS:
        qtype = gguf.GGMLQuantizationType[name]
        if name.endswith("_K"):
            whole = -(-k // 256) * 256
            size = gguf.GGML_QUANT_SIZES[qtype][1]
            raw = rng.integers(0, 256, (n * whole // 256, size), dtype=np.uint8)
            for at in (208,) if name == "Q6_K" else (0, 2):
                raw[:, at : at + 2] = (rng.random((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
            full = from_gguf(raw.reshape(n, -1), name, whole)
            out[name] = None if full is None else full.columns(0, k)
        else:
            out[name] = from_gguf(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype), name, k)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=640)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    from guidespec.worker import kernels

    assert kernels.available(), "the kernels are not built (no C compiler)"
    ws = weights(args.n, args.k)
    best = {(name, m): float("inf") for name in ws for m in args.rows}
    xs = {m: torch.randn(m, args.k) for m in args.rows}
    for _ in range(args.repeats):
        for (name, m), value in best.items():
            start = clock()
            kernels.linear(xs[m], ws[name])  # type: ignore[arg-type]
            best[name, m] = min(value, clock() - start)
    print(f"{machine()}; {args.threads} threads, {'CPU' if args.cpu_time else 'wall'} time; weight {args.n}x{args.k}\n")
    print("| weight | " + " | ".join(f"M={m} ms" for m in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for name in ws:
        print(f"| {name} | " + " | ".join(f"{1000 * best[name, m]:.3f}" for m in args.rows) + " |")


if __name__ == "__main__":
    main()
