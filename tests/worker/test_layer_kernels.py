"""The decoder layer's Triton kernels (worker/kernels/layer_triton.py: RMS norm with the residual
add, SiLU-and-multiply, RoPE) against torch's ops they replace on CUDA, run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before Triton is imported: a child
process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed (xgrammar brings it)")

CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from guidespec.worker.kernels import layer_triton
    from guidespec.worker.model import _rms_norm
    from guidespec.worker.rotary import apply_rope

    def same(got, want, least=1.0):
        # torch's roundings, step by step: equal bits but where a sum's order or an exp's last bit
        # differs. In fp16: the interpreter rounds to bf16 by truncation (the GPU to nearest), so
        # bf16 results are only close here
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        if got.dtype == torch.float16:
            share = (got == want).float().mean().item()
            assert share >= least, share

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for t, hidden in ((5, 576), (1, 64), (3, 100)):
            x = torch.randn(t, hidden, generator=gen).to(dtype)
            delta = torch.randn(t, hidden, generator=gen).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
            total, norm = layer_triton.add_rms_norm(x, delta, weight, 1e-5)
            same(total, x + delta)
            same(norm, _rms_norm(x + delta, weight, 1e-5), 0.98)
            alone, norm = layer_triton.add_rms_norm(x, None, weight, 1e-5)
            assert alone is x
            same(norm, _rms_norm(x, weight, 1e-5), 0.98)
            fp32_weight = weight.float()  # Gemma's: scaled in fp32, then rounded
            same(layer_triton.add_rms_norm(x, None, fp32_weight, 1e-6)[1], _rms_norm(x, fp32_weight, 1e-6), 0.98)
            wide = torch.randn(t, 2 * hidden + 4, generator=gen).to(dtype)[:, :2 * hidden]  # strided rows
            gate, up = wide.chunk(2, dim=-1)
            same(layer_triton.silu_mul(wide), F.silu(gate) * up, 0.98)
        for t, heads, d in ((4, 6, 64), (1, 2, 32)):
            qkv = torch.randn(t, (heads + 1) * d, generator=gen).to(dtype)
            x = qkv[:, : heads * d].view(t, heads, d)  # a view of a wider row, as the model's
            angles = torch.randn(t, d // 2, generator=gen)
            cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
            same(layer_triton.rope(x, cos, sin), apply_rope(x, cos, sin))
    half_table = torch.randn(2, 4).bfloat16()  # a partial rotation: torch's
    assert layer_triton.rope(torch.randn(2, 3, 8).bfloat16(), half_table, half_table) is None
    assert layer_triton.add_rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-5) is None  # fp32: torch's
    print("ok")
""")


def test_the_layer_kernels_equal_torch_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
