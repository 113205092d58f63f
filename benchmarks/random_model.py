"""A Hugging Face Llama folder with random weights for a named config, for speed measurements.

    python -m benchmarks.random_model --preset smollm2-135m [--num-layers 4] [--output DIR]
                                      [--tokenizer-from DIR]

Nothing is downloaded: the model is made from ``transformers.LlamaConfig`` on the meta device,
its weights drawn as N(0, 0.02) in bfloat16 (norms 1), and saved with ``save_pretrained``. The
tokenizer files are copied from ``--tokenizer-from`` (default: the default model's converted
folder, which the first use converts from its GGUF once, ~20 s). The folder is cached: a second
call with the same config returns it at once. Speed does not depend on the weights' values;
anything that depends on what the model predicts (speculative acceptance) does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

# SmolLM2's configs (HuggingFaceTB/SmolLM2-135M-Instruct and -1.7B-Instruct config.json)
_SMOLLM2 = dict(
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
PRESETS: dict[str, dict[str, Any]] = {
    # a forward that costs microseconds: a step's time is the runtime around the model (overhead.py)
    "tiny": dict(
        _SMOLLM2,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=100000.0,
    ),
    "smollm2-135m": dict(
        _SMOLLM2,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
    ),
    "smollm2-1.7b": dict(
        _SMOLLM2,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        rope_theta=130000.0,
    ),
    # Llama-3.1-8B's shape (its 128,256-token vocabulary, untied head): a decode step bound by
    # reading 16 GB of weights (the bandwidth check of issue 48); SmolLM2's tokenizer covers the
    # first 49,152 ids
    "llama-3.1-8b": dict(
        _SMOLLM2,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def preset_config(preset: str, num_layers: int | None = None) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    config = dict(PRESETS[preset])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        config["num_hidden_layers"] = num_layers
    return config


def default_folder(preset: str, num_layers: int | None = None) -> Path:
    return Path("out") / (f"gpu-model-{preset}" + (f"-{num_layers}layers" if num_layers is not None else ""))


def build_random_model(
    preset: str,
    target: Path,
    tokenizer_from: Path | None = None,
    num_layers: int | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """``target`` as a model folder of ``preset`` with random weights (reused if already built).
    ``overrides``: config fields to change (another tokenizer's ``vocab_size`` and special ids)."""
    config = {**preset_config(preset, num_layers), **(overrides or {})}
    marker = {"preset": preset, "config": config, "seed": seed}
    done = target / "DONE"
    try:
        if json.loads(done.read_text()) == marker:
            return target
    except (OSError, ValueError):
        pass
    source = tokenizer_source(tokenizer_from)
    start = time.perf_counter()
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _save_random_weights(config, tmp, seed)
        _copy_tokenizer(source, tmp, config["vocab_size"])
        done_tmp = tmp / "DONE"
        done_tmp.write_text(json.dumps(marker))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"built {preset} ({config['num_hidden_layers']} layers, random weights) in {target} "
        f"in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    return target


def tokenizer_source(tokenizer_from: Path | None) -> Path:
    if tokenizer_from is not None:
        if not (tokenizer_from / "tokenizer.json").exists() and not (tokenizer_from / "tokenizer.model").exists():
            raise FileNotFoundError(f"{tokenizer_from} has no tokenizer.json / tokenizer.model")
        return tokenizer_from
    from guidespec.model_files import resolve_model_dir

    try:
        return resolve_model_dir(None, show_progress=False)
    except Exception as exc:  # no embedded model here: say what to pass instead
        raise SystemExit(
            f"no tokenizer: the default model is not available here ({exc}); pass --tokenizer-from DIR "
            "(a folder with SmolLM2's tokenizer.json, e.g. a model folder built before)"
        ) from exc


def _save_random_weights(config: dict[str, Any], folder: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**config)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    # no init: the weights are drawn below (Module.to: transformers' typed wrapper confuses mypy)
    # drawn on the GPU where there is one and the model is large (8B numbers: minutes on a CPU)
    big = sum(p.numel() for p in model.parameters()) > 2_000_000_000
    device = "cuda" if big and torch.cuda.is_available() else "cpu"
    model = torch.nn.Module.to(model, torch.bfloat16).to_empty(device=device)
    if config["tie_word_embeddings"]:
        model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # RMSNorm weights
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(folder)


def _copy_tokenizer(source: Path, folder: Path, vocab_size: int) -> None:
    import transformers

    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, folder / name)
    # a tokenizer saved by transformers 5 names a class that 4.x lacks: its fast tokenizer reads the same file
    config_path = folder / "tokenizer_config.json"
    if config_path.exists():
        data = json.loads(config_path.read_text())
        if data.get("tokenizer_class") == "TokenizersBackend" and not hasattr(transformers, "TokenizersBackend"):
            data["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(data, indent=2))
    if (folder / "tokenizer.json").exists():
        size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
        if size > vocab_size:
            raise ValueError(f"the tokenizer in {source} has {size} tokens, more than the model's {vocab_size}")


def build_random_eagle_head(model_dir: Path, target: Path, draft_vocab_size: int = 8192, seed: int = 0) -> Path:
    """``target`` as an EAGLE-3 head folder for the model in ``model_dir``, with random weights
    (its LM head: the target's embedding rows of the draft vocabulary, read through d2t). Its
    drafts are nearly always wrong: good for step times, not for acceptance."""
    import dataclasses

    import torch

    from guidespec.config import ModelConfig
    from guidespec.model_files import load_hf_config
    from guidespec.worker.drafting.eagle_head import default_aux_layers, save_head
    from guidespec.entrypoints.train_eagle import TrainableHead, head_config
    from guidespec.worker.checkpoint import ShardReader

    hf = load_hf_config(model_dir)
    target_cfg = ModelConfig.from_hf(hf)
    cfg = dataclasses.replace(target_cfg, num_layers=1)
    embed = ShardReader(model_dir).get("model.embed_tokens.weight").float()
    draft_ids = torch.arange(min(draft_vocab_size, cfg.vocab_size))
    aux = default_aux_layers(target_cfg.num_layers)
    torch.manual_seed(seed)
    head = TrainableHead(cfg, hf, embed, draft_ids, len(aux), 64)
    save_head(
        target, head.state_for_checkpoint(cfg.vocab_size), head_config(cfg, cfg.vocab_size, len(draft_ids), aux, {})
    )
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--output", type=Path, default=None, help="default: out/gpu-model-<preset>")
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    args = parser.parse_args()
    target = args.output or default_folder(args.preset, args.num_layers)
    print(build_random_model(args.preset, target, args.tokenizer_from, args.num_layers))


if __name__ == "__main__":
    main()
