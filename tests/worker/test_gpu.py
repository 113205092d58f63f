"""The GPU path on a GPU (``pytest -m gpu``; skipped, with the reason, where torch sees none).

Greedy output equals Hugging Face's on the same weights and dtype; CUDA graphs equal eager token
for token; TP=2 equals TP=1 (on one GPU, both ranks on it over gloo); guided outputs are valid; speculative
greedy equals plain greedy. The engine tests use a random-weight model of SmolLM2-135M's shape
(``benchmarks/random_model.py``, 4 layers) with the default model's tokenizer, taken from
``GUIDESPEC_TOKENIZER_DIR`` where set (a GPU machine without the default model), so they need no
checkpoint; greedy equality does not depend on the weights' values.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from guidespec import LLM, SamplingParams
from guidespec.config import ModelConfig
from guidespec.llm import GenerationOutput
from guidespec.protocol import GuidedDecoding
from guidespec.model_files import load_hf_config
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from tests.conftest import make_tiny_model, parent_pid

# GUIDESPEC_TEST_DEVICE=cpu runs these on the CPU (to check the tests themselves where there is no GPU)
DEVICE = os.environ.get("GUIDESPEC_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="no CUDA device here: the GPU path is built and CPU-tested but not verified on this machine",
    ),
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = [[1, 504, 3456, 28, 5110, 30], [1, 2683, 314, 253, 1029, 1352, 30], [1, 42, 42, 42, 17, 900]]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.random_model import build_random_model

    tokenizer = os.environ.get("GUIDESPEC_TOKENIZER_DIR")
    return build_random_model(
        "smollm2-135m",
        tmp_path_factory.mktemp("gpu") / "smollm2-4l",
        Path(tokenizer) if tokenizer else None,
        num_layers=4,
    )


def _run(llm: LLM, requests: list[tuple[Any, SamplingParams]]) -> list[GenerationOutput]:
    async def run() -> list[GenerationOutput]:
        return list(await asyncio.gather(*(llm.agenerate(p, sp) for p, sp in requests)))

    return asyncio.run(run())


def _fp32_engine(model: Path, **options: Any) -> LLM:
    """An fp32 engine of 8 rows on the test device, jump-forward off unless ``options`` say."""
    kw: dict[str, Any] = dict(device=DEVICE, dtype="float32", max_batch_size=8, show_progress=False, jump_forward=False)
    return LLM(str(model), **{**kw, **options})


def _greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
def test_model_logits_match_hf_on_the_gpu(tmp_path: Path, dtype: torch.dtype, tol: float) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "m", "llama_odd_heads")
    hf = load_hf_config(folder)
    ours = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), dtype, max_model_len=64, device=DEVICE)
    ours.load(folder, hf, show_progress=False)
    kv = ours.create_kv_cache(1)
    tokens = [5, 17, 42, 99, 3, 250, 7]
    logits = ours.compute_logits(ours.forward(ForwardBatch.create(tokens, [0], [0], [7], [7]), kv))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(DEVICE).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens], device=DEVICE)).logits[0].float()
    assert logits is not None and logits.device.type == DEVICE
    torch.testing.assert_close(logits, expected, atol=tol, rtol=tol)


def test_the_padded_forward_s_kernels_equal_torch_s_in_bf16(
    random_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CUDA graph captures in bf16 (``forward_padded``: RoPE with the cache write and
    attention through the block tables as Triton kernels) against torch's rotation, writes,
    gathers and SDPA, decode and verify rows at ~300 keys (blocks scattered through the pool):
    close (Triton's interpreter, which checks them in CI, cannot multiply bf16)."""
    import numpy as np

    from guidespec.worker import model as model_mod

    hf = load_hf_config(random_model)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.bfloat16, 512, device=DEVICE)
    model.load(random_model, hf, show_progress=False)
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(model_mod, "paged_attention", lambda *a: None)
            monkeypatch.setattr(model_mod.layer_triton, "rope_into_cache", lambda *a: None)
        kv = model.create_kv_cache(3, 16, num_blocks=64)
        tables = np.random.default_rng(0).permutation(64)[:63]
        kv.set_tables(np.array([0, 1, 2]), np.array([21, 21, 21]), tables)
        model.forward(ForwardBatch.create(np.arange(600) % 4000 + 5, [0, 2], [0, 0], [300, 300], [1, 1]), kv)
        for n in (1, 4):
            positions = torch.tensor([[300 + j for j in range(n)], [290 + j for j in range(n)]], device=DEVICE)
            slots = torch.tensor([0, 2], device=DEVICE)
            outs[fused, n] = model.forward_padded(
                kv,
                torch.arange(2 * n, device=DEVICE) + 7,
                positions.view(-1),
                slots.repeat_interleave(n),
                slots,
                n,
                320,
            )
    for n in (1, 4):
        torch.testing.assert_close(outs[True, n].float(), outs[False, n].float(), atol=6e-2, rtol=6e-2)


def test_greedy_output_equals_hf_generate(random_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(random_model, dtype=torch.float32).to(DEVICE).eval()
    reference.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = reference.generate(
                torch.tensor([prompt], device=DEVICE), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
            expected.append(out[0, len(prompt) :].tolist())
    with LLM(str(random_model), device=DEVICE, dtype="float32", max_batch_size=4, show_progress=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())
    assert [o.token_ids for o in outs] == expected


# PERSON's longest compact JSON is 168 characters (a name of 12 characters, each a surrogate
# pair's two \uXXXX escapes), so at most 168 tokens: given more, a guided output ends by its grammar
_GUIDED_MAX_TOKENS = 256


def _mixed(backend: str = "xgrammar") -> list[tuple[Any, SamplingParams]]:
    guided = SamplingParams(
        max_tokens=_GUIDED_MAX_TOKENS,
        temperature=0.0,
        guided=GuidedDecoding(json_schema=json.dumps(PERSON), backend=backend),
    )
    return [({"prompt_token_ids": p}, _greedy()) for p in PROMPTS] + [
        ([{"role": "user", "content": "A person as JSON."}], guided)
    ] * 2


def _assert_people(outputs: list[GenerationOutput]) -> None:
    """``_mixed``'s guided outputs: each a complete PERSON, ended by its grammar (stop), never cut
    off by length (which would leave nothing checked)."""
    guided = outputs[len(PROMPTS) :]
    assert len(guided) == 2 and [o.finish_reason for o in guided] == ["stop", "stop"], guided
    for out in guided:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_cuda_graphs_equal_eager_and_guided_outputs_are_valid(random_model: Path) -> None:
    outputs = {}
    for eager in (False, True):
        with _fp32_engine(random_model, enforce_eager=eager) as llm:
            outputs[eager] = _run(llm, _mixed())
    assert [o.token_ids for o in outputs[False]] == [o.token_ids for o in outputs[True]]
    _assert_people(outputs[False])


def test_engine_processes_forked_by_the_zygote_equal_new_interpreters(
    random_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote (``launch/zygote.py``) imports torch without starting CUDA; what it forks starts
    CUDA itself. ``GUIDESPEC_ZYGOTE=1`` uses it for a CUDA engine (by default only CPU engines do)."""
    runs = {}
    for zygote in ("1", "0"):
        monkeypatch.setenv("GUIDESPEC_ZYGOTE", zygote)
        with _fp32_engine(random_model) as llm:
            runs[zygote] = _run(llm, _mixed())
            parents = {parent_pid(p.pid) for p in llm._processes.processes.values()}
            assert (parents == {os.getpid()}) == (zygote == "0")
    assert [o.token_ids for o in runs["1"]] == [o.token_ids for o in runs["0"]]


def test_bf16_default_serves_guided_json(random_model: Path) -> None:
    with LLM(str(random_model), device=DEVICE, max_batch_size=8, show_progress=False) as llm:
        assert llm.config.dtype == ("bfloat16" if DEVICE == "cuda" else "float32")
        outs = _run(llm, _mixed("llguidance"))
    assert all(len(o.token_ids) > 0 for o in outs)
    _assert_people(outs)


def test_speculative_greedy_equals_plain_greedy(random_model: Path) -> None:
    requests = _mixed() + [("the cat sat on the mat. the cat sat on the mat. the cat", _greedy(32))]
    runs = {}
    for speculative in (None, "ngram"):
        with _fp32_engine(random_model, speculative=speculative) as llm:
            runs[speculative] = _run(llm, requests)
    assert [o.token_ids for o in runs["ngram"]] == [o.token_ids for o in runs[None]]
    assert sum(o.stats.num_spec_steps for o in runs["ngram"]) > 0


def _graph_runs(
    model: Path, speculative: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[GenerationOutput]]:
    """A model drafter's engine with whole greedy steps as captured graphs (``worker/drafting/step_graph.py``:
    verify, acceptance, the drafter and its draft steps, grammar waits as host nodes), its draft
    steps alone as graphs (``GUIDESPEC_FUSED_STEPS=0``), the same steps one by one
    (``graph_grammar=False``), and no speculation; only the first runs fused steps."""
    runs, traces = {}, {}
    for label, options, fused in (
        ("plain", {}, "1"),
        ("fused", dict(speculative=speculative, graph_grammar=True), "1"),
        ("draft graph", dict(speculative=speculative, graph_grammar=True), "0"),
        ("steps", dict(speculative=speculative, graph_grammar=False), "1"),
    ):
        monkeypatch.setenv("GUIDESPEC_FUSED_STEPS", fused)
        traces[label] = tmp_path / f"trace-{label.replace(' ', '-')}.json"
        monkeypatch.setenv("GUIDESPEC_TRACE", str(traces[label]))
        with _fp32_engine(model, **options) as llm:
            runs[label] = _run(llm, _mixed())
    for label in ("fused", "draft graph", "steps"):
        fused_steps = json.loads(traces[label].read_text())["summary"]["fused_steps"]
        assert (fused_steps > 0) == (label == "fused"), (label, fused_steps)
    return runs


def test_eagle_graphs_equal_step_by_step_and_plain_greedy(
    random_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EAGLE engine fused, with draft graphs and step by step: the same greedy tokens as no
    speculation, guided and unguided, with drafts proposed and verified (a random head: few
    accepted)."""
    from benchmarks.random_model import build_random_eagle_head

    head = build_random_eagle_head(random_model, tmp_path / "head")
    eagle = dict(method="eagle", draft_model=str(head), adaptive=False, max_draft_len=3)
    runs = _graph_runs(random_model, eagle, tmp_path, monkeypatch)
    for label in ("fused", "draft graph", "steps"):
        assert [o.token_ids for o in runs[label]] == [o.token_ids for o in runs["plain"]], label
        assert sum(o.stats.num_draft_tokens for o in runs[label]) > 0, label


def test_draft_model_graphs_equal_step_by_step_and_plain_greedy(
    random_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model sharing the target's weights and cache on the GPU (its first 2 layers: many
    drafts rejected) fused (the newest token's forward before the draft steps), with draft graphs
    and step by step: the same greedy tokens as no speculation."""
    speculative = dict(method="draft_model", draft_model="layers:2", adaptive=False, max_draft_len=3)
    runs = _graph_runs(random_model, speculative, tmp_path, monkeypatch)
    for label in ("fused", "draft graph", "steps"):
        assert [o.token_ids for o in runs[label]] == [o.token_ids for o in runs["plain"]], label
        assert sum(o.stats.num_draft_tokens for o in runs[label]) > 0, label


def test_tp2_equals_tp1(random_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 gives TP=1's tokens, guided and not. On two GPUs over NCCL, with graphs; on one, both
    ranks on it over gloo (``GUIDESPEC_TP_BACKEND=gloo``, NCCL's stand-in: the placement, the
    sharded weights and the collectives of CUDA tensors, eagerly: a graph cannot hold gloo's
    collectives); on the CPU (``GUIDESPEC_TEST_DEVICE=cpu``) over gloo."""
    shared = DEVICE == "cuda" and torch.cuda.device_count() < 2
    if shared:
        monkeypatch.setenv("GUIDESPEC_TP_BACKEND", "gloo")
    runs = {}
    for tp in (1, 2):
        with _fp32_engine(
            random_model, tensor_parallel_size=tp, jump_forward=True, enforce_eager=shared and tp == 2
        ) as llm:
            runs[tp] = _run(llm, _mixed())
    assert [o.token_ids for o in runs[2]] == [o.token_ids for o in runs[1]]
    _assert_people(runs[2])
