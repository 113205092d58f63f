"""Reading a model's weights for a worker rank: its own shards of each tensor (``safe_open``
slices), and a converted GGUF folder's original file (``gguf_source``), whose linear weights
:class:`GGUFTensors` reads in their own quantized blocks. Finding the model folder, its config
and its tokenizer is ``guidespec/model_files.py`` (the scheduler needs those too). This module
does not build the model (see ``model.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from guidespec.model_files import ModelNotFoundError, cached_json
from guidespec.worker.kernels.gguf_weights import GGUFWeight, from_gguf


class ShardReader:
    """Reads tensors, or row/column ranges of them, from a folder's safetensors files."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{model_dir} has no .safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        part = self._where[name].get_slice(name)
        if rows is None and cols is None:
            return part[:]
        r0, r1 = rows if rows is not None else (0, part.get_shape()[0])
        if cols is None:
            return part[r0:r1]
        return part[r0:r1, cols[0] : cols[1]]

    def names(self) -> Iterator[str]:
        return iter(self._where)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted folder was made from; None for a plain Hugging Face folder or
    where the file is gone."""
    try:
        source = Path(json.loads((model_dir / "DONE").read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


# GGUF architectures whose 2-D weights are kept, and what transformers' GGUF loader does to them
# (``modeling_gguf_pytorch_utils.TENSOR_PROCESSORS``; the converted folder holds its result): Llama's
# (and Mistral's, whose files say "llama") q and k rows are un-permuted, mirrored here; Qwen2's,
# Qwen3's and Phi-3's are taken as stored (Phi-3's fused attn_qkv, q|k|v, and ffn_up, gate|up, are
# the folder's qkv_proj and gate_up_proj); Gemma 3's too: its processor subtracts 1 from the norms
# only, which are 1-D and never kept. Another architecture's processor may change its weights: none
# of them is kept (they load dequantized).
KEPT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")


class GGUFTensors:
    """A GGUF file's 2-D weights in their own quantized blocks (``kernels.gguf_weights``), by
    Hugging Face name, as ``ShardReader`` reads the dequantized ones, for the architectures in
    :data:`KEPT_ARCHITECTURES`. The rows of Llama's q and k projections are put back in Hugging
    Face's order as transformers' GGUF loader does (its ``LlamaTensorProcessor``): whole rows move,
    so the blocks are untouched. A fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) is read
    whole or by its parts' rows, as ShardReader reads it."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        arch, tensors = _tensor_index(path)
        self._file = np.memmap(path, dtype=np.uint8, mode="r")
        self._tensors = {t.name: t for t in tensors} if arch in KEPT_ARCHITECTURES else {}
        arch_id = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
        num_blocks = 1 + max((int(n.split(".")[1]) for n in self._tensors if n.startswith("blk.")), default=-1)
        self._names = gguf.get_tensor_name_map(arch_id, num_blocks)
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "llama" else {}

    def get(
        self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> GGUFWeight | None:
        """Tensor ``name`` (rows, columns [start, end) as ShardReader.get) as blocks; None where
        the file lacks it, keeps it in a type the kernel does not take, or the columns do not
        fall on blocks."""
        gguf_name = self._names.get_name(name.removesuffix(".weight"))
        if gguf_name is None:
            return None
        tensor = self._tensors.get(gguf_name + ".weight")
        if tensor is None or len(tensor.shape) != 2:
            return None
        n, k = tensor.shape[1], tensor.shape[0]  # GGUF lists the inner dimension first
        data = tensor.data(self._file).reshape(n, -1)
        heads = self._heads.get(gguf_name.rsplit(".", 1)[-1])
        if heads is not None:
            data = data[_unpermuted_rows(n, heads)]
        elif rows is not None:  # read only this rank's rows of the mapped file
            data, rows = data[rows[0] : rows[1]], None
        weight = from_gguf(data, tensor.type_name, k)
        if weight is not None and rows is not None:
            weight = weight.select_rows(slice(*rows))
        if weight is not None and cols is not None:
            weight = weight.columns(*cols)
        return weight


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    """Where a tensor's data lies in its GGUF file, and how ``gguf.GGUFReader`` views it."""

    name: str
    type_name: str  # GGMLQuantizationType's name
    shape: Sequence[int]  # as GGUF lists it, inner dimension first
    offset: int  # bytes from the file's start
    dtype: str  # the reader's view: its numpy dtype and shape (quantized types: bytes per row)
    view_shape: Sequence[int]

    def data(self, file: np.ndarray) -> np.ndarray:
        dtype = np.dtype(self.dtype)
        size = int(np.prod(self.view_shape)) * dtype.itemsize
        return file[self.offset : self.offset + size].view(dtype).reshape(tuple(self.view_shape))


def _tensor_index(path: Path) -> tuple[str, list[_TensorInfo]]:
    """The file's architecture and tensors, as ``gguf.GGUFReader`` finds them, kept in the cache
    directory under the file's path, size, change time and the gguf package's version. Why: the
    reader parses every metadata field, the tokenizer's ~100k strings one numpy view at a time
    (4 s of every engine start on the default model) where a worker needs the tensors' places."""
    stat = path.stat()
    version = importlib.metadata.version("gguf")
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version}".encode()).hexdigest()[:16]

    def read() -> dict[str, Any]:
        import gguf

        reader = gguf.GGUFReader(path)
        tensors = [
            _TensorInfo(
                t.name, t.tensor_type.name, t.shape.tolist(), int(t.data_offset), t.data.dtype.str, t.data.shape
            )
            for t in reader.tensors
        ]
        return {
            "architecture": str(reader.fields["general.architecture"].contents()),
            "tensors": [dataclasses.asdict(t) for t in tensors],
        }

    data = cached_json("gguf-index", key, read)
    return data["architecture"], [_TensorInfo(**t) for t in data["tensors"]]


def _unpermuted_rows(n: int, num_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's rotary permutation: Hugging Face row i is GGUF row
    order[i] (transformers' ``_reverse_permute_weights`` applied to row indices)."""
    return np.arange(n).reshape(num_heads, n // num_heads // 2, 2).swapaxes(2, 1).reshape(-1)
