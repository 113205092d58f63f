"""The command line's shared options: the engine's flags every command takes, and the ``LLM``
arguments made from them. It imports none of the commands (``cli``, ``bench``, ``sweep``), which
all import it."""

from __future__ import annotations

import argparse
from typing import Any


def jump_forward_from_args(args: argparse.Namespace) -> bool | str:
    if args.no_jump_forward:
        return False
    return "unverified" if args.unverified_jump_forward else True


def device_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's placement options (``LLM``'s keyword arguments) from the command line."""
    return {
        "device": args.device,
        "enforce_eager": args.enforce_eager,
        "graph_grammar": args.graph_grammar,
        "grammar_fill_threads": args.grammar_fill_threads,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "ray_placement": args.ray_placement,
    }


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by every command that starts one (``LLM``'s arguments)."""
    _add_model_args(p)
    _add_parallel_args(p)
    _add_device_args(p)
    _add_grammar_args(p)
    _add_speculative_args(p)


def add_jump_forward_args(p: argparse.ArgumentParser) -> None:
    """``--no-jump-forward`` and ``--unverified-jump-forward`` (read by ``jump_forward_from_args``)."""
    p.add_argument("--no-jump-forward", action="store_true", help="sample every token, even forced ones")
    p.add_argument(
        "--unverified-jump-forward",
        action="store_true",
        help="append the grammar's forced text as its own tokenization without asking the model "
        "(faster where forced text is long; the tokens may differ from the model's)",
    )


def speculative_from_args(args: argparse.Namespace) -> dict[str, object] | None:
    """The LLM's ``speculative`` argument from the command line (None: off)."""
    if args.speculative is None:
        return None
    return dict(
        method=args.speculative,
        max_draft_len=args.max_draft_len,
        max_matching_ngram_size=args.max_matching_ngram_size,
        adaptive=not args.no_adaptive_draft,
        use_forced_tokens=not args.no_forced_drafts,
        constrain_drafts=not args.no_constrain_drafts,
        draft_mask_steps=args.draft_mask_steps,
        user_drafter=args.user_drafter,
        draft_model=args.draft_model,
        combine_ngram=args.combine_ngram,
        ngram_fallback=not args.no_ngram_fallback,
        anchored_lookup=not args.no_anchored_lookup,
    )


def engine_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``'s keyword arguments (but the model) from the engine's flags of ``generate`` and ``serve``."""
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        grammar_backend=args.backend,
        jump_forward=jump_forward_from_args(args),
        speculative=speculative_from_args(args),
        distributed_executor=args.distributed_executor,
        ray_address=args.ray_address,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_block_size=args.kv_block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        chat_template=args.chat_template,
        grammar_cache_dir=args.grammar_cache_dir,
        **device_from_args(args),
    )


# ------------------------------------------------------------------ the engine's flags, by concern


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and the engine's limits: which weights, their dtype, the batch and the context."""
    p.add_argument(
        "--model", default=None, help="Hugging Face folder, .gguf file or gemma-3-270m (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "gguf"],
        help="auto: bfloat16 on CUDA; on the CPU a GGUF model's own quantized blocks (gguf), else float32",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_JINJA",
        help="the chat template for chat prompts (a file, or the Jinja text itself), in place of the "
        "tokenizer's own: a base model has none and refuses chat requests without one",
    )
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt whole, even where cached KV blocks hold its first tokens",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="positions per KV cache block (a multiple of 8)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="tokens the KV cache holds, all requests together (default: from memory: on CUDA "
        "--gpu-memory-utilization, on the CPU 40%% of the memory available at start)",
    )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism: how many ranks, and where they run (local processes or Ray actors)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--distributed-executor",
        default="mp",
        choices=["mp", "ray"],
        help="mp: worker ranks as local processes; ray: as Ray actors in a placement group",
    )
    p.add_argument(
        "--ray-address", default=None, help="the Ray cluster to join (default: the current or a new local one)"
    )
    p.add_argument(
        "--ray-placement",
        default="pack",
        choices=["pack", "spread"],
        help="Ray GPU ranks: pack (STRICT_PACK, one node) or spread (STRICT_SPREAD, one rank per node)",
    )


def _add_device_args(p: argparse.ArgumentParser) -> None:
    """The device each rank runs on, how much of a GPU it may take, and what runs as CUDA graphs."""
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="auto: CUDA where torch sees a GPU (rank i on cuda:i), else the CPU",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: the share of each GPU's memory a rank may take (weights, KV cache, activations)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run every step eagerly, without CUDA graphs")
    p.add_argument(
        "--graph-grammar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EAGLE head or draft model: its greedy draft steps as one graph per proposal, grammar waits "
        "inside, and each whole step of greedy and sampled rows (verify and drafts) as one graph "
        "(default: on CUDA with graphs; on the CPU the same steps run eagerly); --no-graph-grammar: one by one",
    )


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    """Guided decoding: the grammar backend, and the scheduler's threads filling the masks."""
    p.add_argument(
        "--grammar-backend",
        "--backend",
        dest="backend",
        default="auto",
        choices=["auto", "xgrammar", "llguidance"],
        help="auto: xgrammar, or llguidance where xgrammar cannot enforce a grammar exactly",
    )
    p.add_argument(
        "--grammar-cache-dir",
        default=None,
        metavar="DIR",
        help="share compiled grammars with other engines through this folder (data-parallel replicas: "
        "a schema is compiled once among them; default: not shared, or a temporary folder the replicas share)",
    )
    p.add_argument(
        "--grammar-fill-threads",
        type=int,
        default=1,
        help="threads filling a step's grammar masks in the scheduler (default 1: a pool's wake-ups cost "
        "more than its rows gain, beside CPU and GPU workers alike)",
    )


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: the drafter and how long, and where, its drafts are."""
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "forced", "user", "draft_model", "eagle"],
        help="drafter: n-gram prompt lookup, grammar-forced tokens only, --user-drafter, --draft-model, "
        "or an EAGLE head (--draft-model HEAD_DIR)",
    )
    spec.add_argument(
        "--draft-model",
        default=None,
        metavar="int8|self|layers:N|PATH",
        help="the draft model: the target rounded to int8, the target itself, its first N layers, or a folder / .gguf; "
        "with --speculative eagle, the EAGLE head folder",
    )
    spec.add_argument("--max-draft-len", type=int, default=3)
    spec.add_argument("--max-matching-ngram-size", type=int, default=4)
    spec.add_argument("--no-adaptive-draft", action="store_true", help="always draft --max-draft-len tokens")
    spec.add_argument("--no-forced-drafts", action="store_true", help="do not draft the grammar's forced tokens")
    spec.add_argument(
        "--no-constrain-drafts",
        action="store_true",
        help="do not cut drafts where the grammar rejects them (to measure what it gains)",
    )
    spec.add_argument(
        "--draft-mask-steps",
        type=int,
        default=None,
        metavar="N",
        help="with a draft model or EAGLE head: mask only a guided row's first N draft steps with its "
        "grammar (fewer round trips to the scheduler; later drafts are still checked); default: all",
    )
    spec.add_argument("--user-drafter", default=None, metavar="MODULE:CLASS")
    spec.add_argument(
        "--combine-ngram",
        action="store_true",
        help="with a draft model or EAGLE head: also prompt lookup; the longer valid draft wins",
    )
    spec.add_argument(
        "--no-ngram-fallback",
        action="store_true",
        help="with a draft model or EAGLE head and the adaptive length: where the draft model would "
        "not pay, draft nothing (default: prompt lookup drafts instead)",
    )
    spec.add_argument(
        "--no-anchored-lookup",
        action="store_true",
        help="n-gram: where no suffix matches, draft nothing (default: look the last word up in the "
        "prompt and let the grammar pick what follows it)",
    )
