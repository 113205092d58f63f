"""The decoder layer's Triton kernels (worker/kernels/layer_triton.py: RMS norm with the residual
add, SiLU-and-multiply, RoPE, RoPE with the cache write; worker/kernels/attention_triton.py:
attention over the paged cache) against torch's ops they replace on CUDA, run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before Triton is imported: a child
process). The interpreter's bf16 matrix products are wrong (its bf16 is raw bits to numpy), so
attention is checked here in fp16, in bf16 by the gpu tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed (xgrammar brings it)")

CHECK = textwrap.dedent("""
    import numpy as np, torch, torch.nn.functional as F
    from guidespec.worker.kernels import attention_triton, layer_triton
    from guidespec.worker.kv_cache import KVCache
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
        # RoPE of q and k with k and v written into a paged cache, against apply_rope and KVCache.write
        for t, hq, hkv, d in ((5, 9, 3, 64), (2, 4, 2, 32)):
            cache = KVCache(1, 4, hkv, 64, d, dtype, block_size=16, num_blocks=20)
            cache.set_tables(np.array([0, 1]), np.array([4, 4]), np.array([7, 3, 12, 0, 5, 1, 19, 2]))
            slots, positions = torch.tensor([0, 1, 0, 1, 1][:t]), torch.tensor([3, 40, 17, 63, 0][:t])
            qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
            angles = torch.randn(t, d // 2, generator=gen)
            cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
            where = cache.locate(slots, positions)
            q = layer_triton.rope_into_cache(qkv, hq, hkv, cos, sin, where, cache.k[0], cache.v[0])
            qk = apply_rope(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
            same(q, qk[:, :hq])
            want = KVCache(1, 4, hkv, 64, d, dtype, block_size=16, num_blocks=20)
            want.set_tables(np.array([0, 1]), np.array([4, 4]), np.array([7, 3, 12, 0, 5, 1, 19, 2]))
            want.write_at(0, where, qk[:, hq:], qkv[:, (hq + hkv) * d :].view(t, hkv, d))
            same(cache.k[0], want.k[0])
            assert torch.equal(cache.v[0], want.v[0])
    # attention through block tables against a dense softmax over each row's keys, fp16
    for b, n, hq, hkv, d, size, length, window in (
        (3, 1, 9, 3, 64, 16, 100, None), (2, 4, 4, 2, 32, 16, 70, None), (2, 2, 8, 2, 16, 8, 200, 37)
    ):
        k_cache = torch.randn(hkv, 65, size, d, generator=gen).half()
        v_cache = torch.randn(hkv, 65, size, d, generator=gen).half()
        tables = torch.stack([torch.randperm(64, generator=gen)[: -(-length // size)] for _ in range(b)])
        first = torch.randint(0, length - n + 1, (b, 1), generator=gen)
        positions = (first + torch.arange(n)).reshape(-1)
        q = torch.randn(b * n, hq, d, generator=gen).half()
        got = attention_triton.paged_attention(q, k_cache, v_cache, tables, positions, n, length, window)
        g = hq // hkv
        for row in range(b):
            keys = k_cache[:, tables[row]].reshape(hkv, -1, d)[:, :length].float()
            values = v_cache[:, tables[row]].reshape(hkv, -1, d)[:, :length].float()
            for j in range(n):
                token, where = row * n + j, torch.arange(length)
                seen = (where <= positions[row * n + j]) & (where > positions[row * n + j] - (window or length + 1))
                scores = torch.einsum("hgd,hkd->hgk", q[token].float().view(hkv, g, d), keys) * d**-0.5
                want = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values
                torch.testing.assert_close(got[token].float(), want.reshape(-1), atol=2e-3, rtol=2e-3)
    assert attention_triton.paged_attention(torch.randn(2, 4, 16), k_cache, v_cache, tables, positions, 1, 8) is None
    half_table = torch.randn(2, 4).bfloat16()  # a partial rotation: torch's
    assert layer_triton.rope(torch.randn(2, 3, 8).bfloat16(), half_table, half_table) is None
    assert layer_triton.add_rms_norm(torch.randn(2, 8), None, torch.ones(8), 1e-5) is None  # fp32: torch's
    print("ok")
""")


def test_the_layer_kernels_equal_torch_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


PADDED = textwrap.dedent("""
    import sys, tempfile
    from pathlib import Path
    import numpy as np, torch
    sys.path.insert(0, "tests")
    from conftest import make_tiny_model
    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config
    from guidespec.worker import model as model_mod
    from guidespec.worker.forward_batch import ForwardBatch
    from guidespec.worker.tp import TPInfo

    kernels = model_mod.paged_attention, model_mod.layer_triton.rope_into_cache
    for kind in ("qwen3", "gemma3", "phi3"):  # (Llama's layout and Mistral's window: in qwen3's and gemma3's)
        folder = make_tiny_model(Path(tempfile.mkdtemp()) / kind, kind)
        hf = load_hf_config(folder)
        model = model_mod.LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float16, 64)
        model.load(folder, hf, show_progress=False)
        outs, ran = {}, []
        for fused in (True, False):
            attention, rope = kernels if fused else (lambda *a: None, lambda *a: None)
            model_mod.paged_attention = lambda *a: ran.append(attention(*a)) or ran[-1]
            model_mod.layer_triton.rope_into_cache = rope
            kv = model.create_kv_cache(3, 16, num_blocks=12)
            kv.set_tables(np.array([0, 1, 2]), np.array([4, 4, 4]), np.array([3, 7, 1, 9, 0, 2, 11, 5, 4, 6, 8, 10]))
            model.forward(ForwardBatch.create(np.arange(50) % 250, [0, 2], [0, 0], [27, 23], [1, 1]), kv)
            outs[fused] = model.forward_padded(
                kv, torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([27, 28, 29, 23, 24, 25]),
                torch.tensor([0, 0, 0, 2, 2, 2]), torch.tensor([0, 2]), 3, 48,
            )
        assert ran and all(out is not None for out in ran[: model.cfg.num_layers]), kind
        torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=2e-2, rtol=2e-2)
    print("ok")
""")


def test_the_padded_forward_through_the_kernels_equals_torch_s() -> None:
    """``forward_padded`` (what a CUDA graph captures) with RoPE-and-write and paged attention as
    Triton kernels against torch's rotation, writes, gathers and SDPA, fp16, the families' layouts
    (q/k norms, Gemma's norms, windows and two RoPE tables, Phi-3's partial rotation: torch's RoPE
    there), in the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", PADDED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
