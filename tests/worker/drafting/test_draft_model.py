"""The draft model follows the target lazily: a row not asked for drafts holds its final tokens
back, and when it is asked (or after a step without logits) the draft model runs them in one
chunk and drafts exactly what it drafts when it follows every step — for the target drafting
for itself, the target's own greedy continuation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from guidespec.config import ModelConfig
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_model import DraftRunner, draft_model_bytes
from guidespec.model_files import load_hf_config
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaModel]:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 64)
    model.load(folder, hf, show_progress=False)
    return folder, model


def _greedy(model: LlamaModel, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        batch = ForwardBatch.create(out, [0], [0], [len(out)], [1])
        logits = model.compute_logits(model.forward(batch, model.create_kv_cache(1)))
        assert logits is not None
        out.append(int(logits[0].argmax()))
    return out[len(tokens) :]


def _step_inputs(tokens: np.ndarray, start: int, draft_len: int) -> StepInputs:
    one = lambda dtype, value=0: np.full(1, value, dtype=dtype)  # noqa: E731
    return StepInputs(
        step=0,
        slots=one(np.int32),
        start_positions=one(np.int32, start),
        num_new_tokens=one(np.int32, len(tokens)),
        token_ids=tokens,
        num_logits=one(np.int32, 1),
        temperature=one(np.float32),
        top_k=one(np.int32),
        top_p=one(np.float32, 1.0),
        seeds=one(np.int64, -1),
        sample_index=one(np.int32),
        num_prompt_tokens=one(np.int32, 7),
        penalties=np.ones((1, 3), np.float32),
        draft_lens=np.array([draft_len], np.int32),
        draft_masked=np.zeros(1, np.int32),
    )


@torch.inference_mode()
def test_lazy_following_drafts_the_targets_greedy_continuation(target) -> None:  # type: ignore[no-untyped-def]
    """So it does when a fused step (step_graph.py) catches the draft model up first
    (``catch_up``, before the step, which follows only the step's own tokens)."""
    folder, model = target
    prompt = [5, 9, 13, 7, 3, 11, 2]
    # (tokens, start, the token the step produced; None: a prefill chunk without logits)
    steps = [(prompt[:4], 0, None), (prompt[4:], 4, 40), ([40], 7, 41), ([41], 8, 42), ([42], 9, 43)]
    expected = _greedy(model, prompt + [40, 41, 42, 43], 3)
    for mode in ("eager", "lazy", "caught up"):
        runner = DraftRunner("self", folder, torch.float32, max_batch_size=1, max_model_len=64, target_vocab_size=300)
        for i, (tokens, start, produced) in enumerate(steps):
            ids = np.array(tokens, np.int32)
            last = i == len(steps) - 1
            wanted = 3 if mode == "eager" or last else 0
            if mode == "caught up" and last:  # the held tokens: the prompt's, then 40 and 41
                assert runner.catch_up(_step_inputs(ids, start, wanted)) == len(prompt) + 2
                assert runner.backlog == {} and runner.catch_up(_step_inputs(ids, start, wanted)) == 0
            runner.follow(ForwardBatch.create(ids, [0], [start], [len(ids)], [0 if produced is None else 1]))
            if produced is None:
                continue  # the worker returns before proposing when a step has no logits
            drafts, counts = runner.propose(
                _step_inputs(ids, start, wanted), np.array([produced], np.int32), np.array([1], np.int32)
            )
            assert counts.tolist() == [wanted]
            if mode != "eager" and wanted == 0:
                assert runner.backlog[0] == (0, prompt + [40, 41, 42][: i - 1])  # held back, not run
        assert runner.backlog == {} and drafts.tolist() == expected, mode


def _verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The target's tokens for a row of 1 + len(drafts) logits: accepted drafts, then its own."""
    out = []
    for j, row in enumerate(logits):
        out.append(int(row.argmax()))
        if j == len(drafts) or drafts[j] != out[-1]:
            break
    return out


@torch.inference_mode()
@pytest.mark.parametrize("spec", ["self", "layers:1"])
def test_a_view_of_the_target_drafts_what_its_own_copy_drafts(target, spec: str) -> None:  # type: ignore[no-untyped-def]
    """At TP=1 ``self`` and ``layers:N`` share the target's weights and KV cache: no prompt is run
    through the draft model, yet through a prefill chunk, accepted and rejected drafts and steps
    without proposals it drafts exactly what a draft model with its own cache drafts."""
    folder, model = target
    kv = model.create_kv_cache(1)
    shared = DraftRunner(spec, folder, torch.float32, 1, 64, 300, (model, kv))
    own = DraftRunner(spec, folder, torch.float32, 1, 64, 300)
    assert shared.shared and not own.shared
    assert shared.model.layers[0] is model.layers[0] and shared.kv.k[0] is kv.k[0]
    prompt = [5, 9, 13, 7, 3, 11, 2, 17, 4]
    first = ForwardBatch.create(np.array(prompt[:5], np.int32), [0], [0], [5], [0])  # a chunk without logits
    model.forward(first, kv)
    for runner in (shared, own):
        runner.follow(first)
    start, pending, drafts, produced, rejected = 5, prompt[5:], [], [], 0
    for wanted in [3, 0, 2, 3, 1, 3, 3, 3]:
        tokens = pending + drafts
        batch = ForwardBatch.create(np.array(tokens, np.int32), [0], [start], [len(tokens)], [1 + len(drafts)])
        logits = model.compute_logits(model.forward(batch, kv))
        assert logits is not None
        for runner in (shared, own):
            runner.follow(batch)
        out = _verify_greedy(logits, drafts)
        produced += out
        rejected += len(drafts) - (len(out) - 1)
        inputs = _step_inputs(np.array(tokens, np.int32), start, wanted)
        inputs.num_logits[:] = 1 + len(drafts)
        proposals = [
            runner.propose(inputs, np.array(out, np.int32), np.array([len(out)], np.int32))[0].tolist()
            for runner in (shared, own)
        ]
        assert proposals[0] == proposals[1] and len(proposals[0]) == wanted
        start += len(pending) - 1 + len(out)  # the newest token's position
        pending, drafts = [out[-1]], proposals[0]
    assert produced == _greedy(model, prompt, len(produced))  # greedy verification kept the target's text
    assert (rejected == 0) == (spec == "self")  # the whole model's drafts are all accepted, one layer's not
    assert shared.backlog == {}  # nothing held back: the target's cache has it all


def test_draft_model_memory_is_what_it_loads(target) -> None:  # type: ignore[no-untyped-def]
    """What rank 0's memory check counts for a draft model (``draft_model_bytes``): nothing for a
    view of the target sharing its cache (TP=1), else the weights and cache it really loads."""
    folder, model = target
    assert draft_model_bytes("self", folder, model.cfg, torch.float32, 1, 5, 64) == 0
    assert draft_model_bytes("layers:1", folder, model.cfg, torch.float32, 1, 5, 64) == 0
    own = DraftRunner("layers:1", folder, torch.float32, max_batch_size=4, max_model_len=64, target_vocab_size=300)
    tensors = [own.model.embed, own.model.final_norm] + [w for layer in own.model.layers for w in layer.values()]
    if own.model.lm_head is not own.model.embed:
        tensors.append(own.model.lm_head)
    loaded = sum(int(np.prod(t.shape)) * 4 for t in tensors) + sum(t.numel() * 4 for t in own.kv.k + own.kv.v)
    assert draft_model_bytes("layers:1", folder, model.cfg, torch.float32, 2, 5, 64) == loaded  # (TP=2: its own)
    int8 = draft_model_bytes("int8", folder, model.cfg, torch.float32, 1, 5, 64)  # a rounded copy, the target's cache
    assert int8 == draft_model_bytes("self", folder, model.cfg, torch.float32, 2, 0, 64) > 0
