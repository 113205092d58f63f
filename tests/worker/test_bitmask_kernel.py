"""Our Triton bitmask kernel (worker/kernels/bitmask_triton.py) against NumPy, run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before Triton is imported: a child
process), and on the GPU where there is one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (xgrammar brings it)")

CHECK = textwrap.dedent("""
    import numpy as np, torch
    from guidespec.worker.kernels.bitmask_triton import apply_rows

    def reference(logits, rows, bitmask):
        out = logits.copy()
        bits = (bitmask.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
        allowed = bits.reshape(len(rows), bitmask.shape[1] * 32)[:, : logits.shape[1]].astype(bool)
        for i, r in enumerate(rows):
            out[r][~allowed[i]] = -np.inf
        return out

    rng = np.random.default_rng(0)
    for vocab, num_logits, rows, dtype in [(1000, 6, [4, 0, 2], torch.float32), (2085, 5, [3], torch.float32),
                                           (100, 4, [], torch.float32), (1100, 3, [2, 1], torch.bfloat16)]:
        words = -(-vocab // 32)
        logits = torch.from_numpy(rng.normal(size=(num_logits, vocab)).astype(np.float32)).to(dtype)
        bitmask = rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
        bitmask[:, -1] = -1  # bits past the vocabulary set: they must not be written
        expected = reference(logits.float().numpy(), rows, bitmask)
        apply_rows(logits, torch.tensor(rows, dtype=torch.int64), torch.from_numpy(bitmask))
        np.testing.assert_array_equal(logits.float().numpy(), expected)
    print("ok")
""")


def test_the_kernel_equals_numpy_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the kernel runs in the interpreter only")
def test_the_kernel_equals_torch_on_the_gpu() -> None:
    from guidespec.worker.kernels.bitmask_triton import apply_rows
    from guidespec.worker.mask import apply_bitmask

    rng = np.random.default_rng(1)
    vocab, words = 49152, 1536
    logits = torch.randn(64, vocab, device="cuda")
    expected = logits.clone()
    rows = np.sort(rng.choice(64, size=40, replace=False))
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(40, words), dtype=np.int64).astype(np.int32))
    apply_bitmask(expected, rows, bitmask)
    apply_rows(logits, torch.from_numpy(rows).cuda(), bitmask.cuda())
    torch.testing.assert_close(logits, expected)
