"""The model families (``ModelConfig``'s switches) equal Hugging Face transformers on tiny random
models built with transformers' own classes: Llama 3's RoPE scaling, Mistral windowed, Qwen3,
Gemma 3 and Phi-3. Logits in fp32 (1e-4) and bf16, TP=2, step-by-step decoding through the C
stack, sliding windows run past, RoPE tables; a whole engine's greedy output equals HF
``generate``, and its speculative greedy output its plain one."""

from __future__ import annotations

import asyncio

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.multiprocessing as mp

from guidespec.config import ModelConfig
from guidespec.llm import GenerationOutput
from guidespec.model_files import load_hf_config
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo, destroy_distributed, init_distributed
from tests.conftest import FAMILY_KINDS, make_tiny_base_model, make_tiny_model
from tests.worker.test_model_vs_hf import hf_logits, our_logits

# longer than every tiny window (5, 6), shorter than Phi-3's original 16 positions (where
# transformers switches the whole sequence to LongRoPE's long factors)
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7, 81, 9, 120, 33, 64, 2, 18],
    [11, 12, 13, 14, 15, 16, 17, 18, 19],
    [201, 7, 7, 9, 100, 44, 45, 46, 47, 48, 200],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {kind: make_tiny_model(root / kind, kind) for kind in FAMILY_KINDS}


def _model(folder: Path, dtype: torch.dtype = torch.float32, max_model_len: int = 64) -> LlamaModel:
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), dtype, max_model_len)
    model.load(folder, hf, show_progress=False)
    return model


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_logits_match_hf(folders: dict[str, Path], kind: str) -> None:
    """A prefill chunk, then the rest of each prompt in a batch of mixed lengths."""
    for ours, ref in zip(our_logits(folders[kind], PROMPTS), hf_logits(folders[kind], PROMPTS)):  # type: ignore[arg-type]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["mistral_window", "qwen3", "gemma3"])
def test_decoding_token_by_token_matches_hf(folders: dict[str, Path], kind: str) -> None:
    """One row decoding a token a step past its window: the whole stack in C where the layout is
    Llama's (Mistral's windows included), the Python loop elsewhere."""
    model, prompt = _model(folders[kind]), PROMPTS[0]
    kv = model.create_kv_cache(1)
    steps = [model.forward(ForwardBatch.create(prompt[:3], [0], [0], [3], [3]), kv)]
    steps += [model.forward(ForwardBatch.create([t], [0], [p], [1], [1]), kv) for p, t in enumerate(prompt) if p >= 3]
    assert (model._stack is not None) == (kind == "mistral_window")
    ours = model.compute_logits(torch.cat(steps))
    torch.testing.assert_close(ours, hf_logits(folders[kind], [prompt])[0], atol=1e-4, rtol=0)


def test_a_draft_model_of_the_first_layers_equals_hf_cut_there(folders: dict[str, Path]) -> None:
    """``first_layers`` (a draft model sharing the target's weights) keeps each layer's own RoPE
    table and window: Gemma 3's first two layers (windowed, then full) equal transformers' model
    of two layers."""
    from transformers import AutoModelForCausalLM

    cut, prompt = _model(folders["gemma3"]).first_layers(2), PROMPTS[0]
    kv = cut.create_kv_cache(1)
    ours = cut.compute_logits(cut.forward(ForwardBatch.create(prompt, [0], [0], [len(prompt)], [len(prompt)]), kv))
    reference = AutoModelForCausalLM.from_pretrained(folders["gemma3"], dtype=torch.float32, num_hidden_layers=2)
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_bf16_logits_match_hf(folders: dict[str, Path], kind: str) -> None:
    """bf16 (the torch path): Gemma's norms scale in fp32 before rounding, Qwen's after, as in
    transformers; within bf16's tolerance of the GPU test."""
    from transformers import AutoModelForCausalLM

    model, prompt = _model(folders[kind], torch.bfloat16), PROMPTS[0]
    kv = model.create_kv_cache(1)
    ours = model.compute_logits(model.forward(ForwardBatch.create(prompt, [0], [0], [len(prompt)], [len(prompt)]), kv))
    reference = AutoModelForCausalLM.from_pretrained(folders[kind], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=6e-2, rtol=6e-2)


TP_KINDS = ("qwen3", "gemma3")


def _tp_ranks(rank: int, folders: list[Path], init: str, out: Path) -> None:
    """Rank ``rank`` of 2 computing each folder's logits (one pair of processes for them all)."""
    init_distributed(TPInfo(rank, 2), init)
    try:
        logits = [our_logits(folder, PROMPTS, TPInfo(rank, 2)) for folder in folders]
        if rank == 0:
            torch.save(logits, out)
        else:
            assert logits == [None] * len(folders)
    finally:
        destroy_distributed()


def test_tp2_logits_match_hf(tmp_path: Path, folders: dict[str, Path]) -> None:
    """Two ranks, a key/value head each, q/k norms whole on both: Qwen3 and Gemma 3."""
    from guidespec.launch.launcher import _free_port

    out, init = tmp_path / "logits.pt", f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_tp_ranks, args=([folders[k] for k in TP_KINDS], init, out), nprocs=2, start_method="spawn")
    for kind, logits in zip(TP_KINDS, torch.load(out)):
        for ours, ref in zip(logits, hf_logits(folders[kind], PROMPTS)):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_gemma3_rotary_tables_are_transformers_per_layer_type() -> None:
    """Gemma 3's two tables (a local base and a global one, the global one linearly scaled as in
    the bigger Gemmas), each equal to transformers' own for its layer type."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from guidespec.worker.rotary import rotary_tables

    config = Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    module = Gemma3RotaryEmbedding(config)
    for layer_type in ("full_attention", "sliding_attention"):
        cos, sin = module(torch.zeros(1), torch.arange(512)[None], layer_type)
        ours = rotary_tables(config, 512, layer_type)
        assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


def test_longrope_tables_switch_to_the_long_factors_by_position(folders: dict[str, Path]) -> None:
    """Phi-3's LongRoPE (half of each head rotated): transformers' tables of a sequence within the
    original length below it, of a longer sequence from it on (each position by its own place,
    as vLLM's per-position cache)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from guidespec.worker.rotary import rotary_tables

    config = load_hf_config(folders["phi3"])
    module = Phi3RotaryEmbedding(config)
    cos, sin = rotary_tables(config, 64)
    assert cos.shape == (64, 8)
    short_cos, short_sin = module(torch.zeros(1), torch.arange(16)[None])
    long_cos, long_sin = module(torch.zeros(1), torch.arange(64)[None])
    assert torch.equal(cos[:16], short_cos[0]) and torch.equal(sin[:16], short_sin[0])
    assert torch.equal(cos[16:], long_cos[0, 16:]) and torch.equal(sin[16:], long_sin[0, 16:])
    assert not torch.equal(short_cos[0], long_cos[0, :16])  # (the two factor sets do differ)


@pytest.mark.parametrize(
    "kind,change,message",
    [
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ("gemma3", {"model_type": "gemma3"}, "'gemma3_text'"),
        ("qwen3", {"hidden_act": "relu"}, "activation 'relu' is not supported"),
        ("qwen3", {"layer_types": ["chunked_attention"] * 3}, "layer types .* are not supported"),
        ("llama3", {"model_type": "gpt2"}, "model type 'gpt2' is not supported"),
    ],
)
def test_layouts_not_computed_are_refused_by_name(
    folders: dict[str, Path], kind: str, change: dict[str, Any], message: str
) -> None:
    from types import SimpleNamespace

    from guidespec.model_files import config_data

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(SimpleNamespace(**{**config_data(folders[kind]), **change}))


# ---------------------------------------------------------------------------- whole engines


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The engine tests' models: tiny ones with a byte-level tokenizer of their 257 ids."""
    root = tmp_path_factory.mktemp("served")
    return {kind: make_tiny_base_model(root / kind, kind) for kind in ("qwen3", "gemma3")}


ENGINE_PROMPTS = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33], [40, 40, 41, 40, 40, 41, 40], [9, 9]]


def _hf_greedy(folder: Path, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    out = []
    with torch.no_grad():
        for prompt in ENGINE_PROMPTS:
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt) :].tolist())
    return out


def _engine_greedy(folder: Path, max_tokens: int, **options: Any) -> list[GenerationOutput]:
    from guidespec import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # max_model_len past the windows: no longer capped at a model's sliding window
    with LLM(str(folder), max_batch_size=4, max_model_len=128, show_progress=False, **options) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], params)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_engine_greedy_equals_hf_generate(served: dict[str, Path], kind: str) -> None:
    outputs = _engine_greedy(served[kind], 24)
    assert [o.token_ids for o in outputs] == _hf_greedy(served[kind], 24)


def test_speculative_greedy_equals_plain_greedy(served: dict[str, Path]) -> None:
    """n-gram drafts verified several tokens a row at a time, past Gemma 3's windows: the output
    is HF's greedy one, which plain greedy equals (above)."""
    outputs = _engine_greedy(served["gemma3"], 32, speculative={"method": "ngram", "max_draft_len": 3})
    assert [o.token_ids for o in outputs] == _hf_greedy(served["gemma3"], 32)
    assert sum(o.stats.num_accepted_tokens for o in outputs) > 0  # drafts were verified, and some accepted


def test_gemma_3_270m_greedy_equals_hf_and_guided_outputs_are_valid(gemma_model_dir: Path) -> None:
    """The real Gemma 3 270M (Q4_K_M GGUF, its own blocks: Q8_0, Q5_0, Q4_K, Q6_K; installed by
    ``scripts/setup.sh --gemma``, skipped without): greedy output equals HF's on completions, with
    n-gram drafts too; guided JSON, regex and choice valid under both backends."""
    from transformers import AutoModelForCausalLM

    from guidespec import LLM, SamplingParams
    from guidespec.model_files import GEMMA_3_270M, load_tokenizer
    from guidespec.protocol import GuidedDecoding

    tokenizer = load_tokenizer(gemma_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was a little"]
    prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    pattern, choices = r"[A-Z][a-z]{2,8} [0-9]{1,3}", ("Paris", "London", "Rome")
    grammars = [
        GuidedDecoding(json_schema=json.dumps(schema)),
        GuidedDecoding(regex=pattern),
        GuidedDecoding(choice=choices),
    ]
    with LLM(GEMMA_3_270M, max_batch_size=8, max_model_len=1024, speculative="ngram", show_progress=False) as llm:
        plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculative=False)
        drafted = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculative=True)
        ours = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], plain)]
        spec = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], drafted)]
        kinds = [(backend, grammar) for backend in ("xgrammar", "llguidance") for grammar in grammars]

        async def guided_at_once() -> list[Any]:  # (one batch: six compiles and runs overlap)
            question = "Q: The largest city in France and its population?\nA:"
            return list(
                await asyncio.gather(
                    *(
                        llm.agenerate(
                            question,
                            SamplingParams(
                                max_tokens=64, temperature=0.0, guided=dataclasses.replace(grammar, backend=backend)
                            ),
                        )
                        for backend, grammar in kinds
                    )
                )
            )

        answers = {
            (backend, grammar.kind): (out.text, out.finish_reason)
            for (backend, grammar), out in zip(kinds, asyncio.run(guided_at_once()))
        }
    ref = AutoModelForCausalLM.from_pretrained(gemma_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        runs = [ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None) for p in prompts]
    expected = [run[0, len(p) :].tolist() for run, p in zip(runs, prompts)]
    assert ours == expected, [tokenizer.decode(t) for t in ours + expected]
    assert spec == ours
    for (backend, kind), (text, reason) in answers.items():
        assert reason == "stop", (backend, kind, text, reason)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch(pattern, text) if kind == "regex" else text in choices, (backend, kind, text)
