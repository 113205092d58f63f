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
from guidespec.spec.draft_model import DraftRunner
from guidespec.worker.checkpoint import load_hf_config
from guidespec.worker.model import ForwardBatch, LlamaModel
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
    return out[len(tokens):]


def _step_inputs(tokens: np.ndarray, start: int, draft_len: int) -> StepInputs:
    one = lambda dtype, value=0: np.full(1, value, dtype=dtype)  # noqa: E731
    return StepInputs(step=0, slots=one(np.int32), start_positions=one(np.int32, start),
                      num_new_tokens=one(np.int32, len(tokens)), token_ids=tokens, num_logits=one(np.int32, 1),
                      temperature=one(np.float32), top_k=one(np.int32), top_p=one(np.float32, 1.0),
                      seeds=one(np.int64, -1), sample_index=one(np.int32), num_prompt_tokens=one(np.int32, 7),
                      penalties=np.ones((1, 3), np.float32), draft_lens=np.array([draft_len], np.int32),
                      draft_masked=np.array([False]))


@torch.inference_mode()
def test_lazy_following_drafts_the_targets_greedy_continuation(target) -> None:  # type: ignore[no-untyped-def]
    folder, model = target
    prompt = [5, 9, 13, 7, 3, 11, 2]
    # (tokens, start, the token the step produced; None: a prefill chunk without logits)
    steps = [(prompt[:4], 0, None), (prompt[4:], 4, 40), ([40], 7, 41), ([41], 8, 42), ([42], 9, 43)]
    expected = _greedy(model, prompt + [40, 41, 42, 43], 3)
    for mode in ("eager", "lazy"):
        runner = DraftRunner("self", folder, torch.float32, max_batch_size=1, max_model_len=64, target_vocab_size=300)
        for i, (tokens, start, produced) in enumerate(steps):
            ids = np.array(tokens, np.int32)
            runner.follow(ForwardBatch.create(ids, [0], [start], [len(ids)], [0 if produced is None else 1]))
            if produced is None:
                continue  # the worker returns before proposing when a step has no logits
            wanted = 3 if mode == "eager" or i == len(steps) - 1 else 0
            drafts, counts = runner.propose(_step_inputs(ids, start, wanted), np.array([produced], np.int32),
                                            np.array([1], np.int32))
            assert counts.tolist() == [wanted]
            if mode == "lazy" and wanted == 0:
                assert runner.backlog[0] == (0, prompt + [40, 41, 42][: i - 1])  # held back, not run
        assert runner.backlog == {} and drafts.tolist() == expected, mode
