"""Every layer of a forward in one C call (``decoder.c``): :class:`DecoderStack` holds the layers'
weights as the C structs read them."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from guidespec.worker.kernels import loader
from guidespec.worker.kernels.gguf_weights import GGUFWeight
from guidespec.worker.kernels.ops import fp32_cpu
from guidespec.worker.kernels.weights import PackedWeight, QuantizedWeight, Weight


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("format", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("window", ctypes.c_int),
    ]


def _linear_struct(weight: Weight, bias: torch.Tensor | None) -> _Linear | None:
    if bias is not None and not fp32_cpu(bias):
        return None
    n, k = weight.shape
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weight, GGUFWeight):
        qs, s0, s1 = weight.kernel_layout().pointers()
        return _Linear(2, weight.fmt, n, k, qs, s0, s1, bias_ptr)
    if isinstance(weight, QuantizedWeight):
        return _Linear(1, 0, n, k, weight.blocks.data_ptr(), weight.scale.data_ptr(), None, bias_ptr)
    if isinstance(weight, PackedWeight):
        return _Linear(0, 0, n, k, weight.blocks.data_ptr(), None, None, bias_ptr)
    return None


class DecoderStack:
    """A model's layers as ``decoder.c`` reads them: built once from the layers' weights (the
    model keeps them alive), the KV cache's pointers set per cache. :meth:`of` is None where a
    weight is of a kind the C stack does not take (the model's Python loop runs then)."""

    def __init__(self, layers: ctypes.Array, keep: list[torch.Tensor]) -> None:
        self.layers, self._keep = layers, keep
        self._kv: object = None

    @classmethod
    def of(cls, layers: list[dict[str, Any]], windows: list[int | None] | None = None) -> DecoderStack | None:
        """The stack of Llama-layout ``layers``, layer i attending a sliding window of
        ``windows[i]`` keys where that is not None."""
        if loader.library() is None:
            return None
        structs = (_Layer * len(layers))()
        keep = []
        for i, (struct, layer) in enumerate(zip(structs, layers)):
            struct.window = (windows[i] if windows else None) or 0
            norms = [layer["input_norm"].float().contiguous(), layer["post_norm"].float().contiguous()]
            keep += norms
            struct.input_norm, struct.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
            for name, bias in (("qkv", "qkv_bias"), ("o", "o_bias"), ("gate_up", None), ("down", None)):
                linear_struct = _linear_struct(layer[name], layer.get(bias) if bias else None)
                if linear_struct is None:
                    return None
                setattr(struct, name, linear_struct)
        return cls(structs, keep)

    def run(
        self,
        x: torch.Tensor,
        kv: Any,
        final_norm: torch.Tensor,
        eps: float,
        dims: tuple[int, int, int, int],
        rotary: tuple[torch.Tensor, torch.Tensor],
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        n: int,
    ) -> torch.Tensor | None:
        """The layers and the final norm over embeddings x [T, H] (B rows of ``n`` tokens), keys
        and values written into ``kv`` (a KVCache): the normalized hidden states [T, H], or None
        where the kernels do not apply. dims: heads, key/value heads, head dim, intermediate
        size; rotary: the [max_len, D] cos and sin tables; rows: positions and cache rows (block *
        block_size + offset) per token (int64), the rows' block tables [B, W] and first positions
        [B] (int32): see ``ops.cache_attention``."""
        lib = loader.library()
        positions, token_rows, tables, row_starts = (t.contiguous() for t in rows)
        if lib is None or not fp32_cpu(final_norm, *rotary) or dims[2] % 16:
            return None
        if self._kv is not kv:  # point the layers at this cache's keys and values
            if not fp32_cpu(*kv.k, *kv.v):
                return None
            for struct, k, v in zip(self.layers, kv.k, kv.v):
                struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
            self._kv = kv
        x = x.float().contiguous().clone()  # written in place: the residual stream
        hidden = torch.empty_like(x)
        hq, hkv, d, inter = dims
        lib.decoder_forward_f32(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            ctypes.addressof(self.layers),
            len(self.layers),
            final_norm.data_ptr(),
            eps,
            hq,
            hkv,
            d,
            inter,
            rotary[0].data_ptr(),
            rotary[1].data_ptr(),
            positions.data_ptr(),
            token_rows.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            row_starts.data_ptr(),
            len(tables),
            n,
            kv.k[0].shape[2],
            kv.k[0].shape[1],
            d**-0.5,
            hidden.data_ptr(),
            loader.threads(),
        )
        return hidden
