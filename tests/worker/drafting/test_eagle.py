"""EAGLE heads: the trained head (autograd, training-time test) and the inference head (KV cache,
draft chain) compute the same thing; both checkpoint layouts load; the d2t map reads the target
mask right; bad head folders are refused with a message."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from guidespec.config import ModelConfig
from guidespec.protocol import StepInputs
from guidespec.worker.drafting.draft_model import apply_masks, post_masks
from guidespec.worker.drafting.eagle import EagleRunner
from guidespec.worker.drafting.eagle_head import EagleHead, default_aux_layers, head_bytes, save_head
from guidespec.entrypoints.train_eagle import TrainableHead, head_config
from guidespec.model_files import load_hf_config
from guidespec.worker.kernels import dense
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaModel, object]:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, 64)
    model.load(folder, hf, show_progress=False)
    return folder, model, hf


def _random_head(model: LlamaModel, hf: object, draft_ids: torch.Tensor, heads: int = 2) -> TrainableHead:
    cfg = dataclasses.replace(model.cfg, num_layers=1, num_heads=heads, num_kv_heads=1, intermediate_size=96)
    torch.manual_seed(1)
    head = TrainableHead(cfg, hf, dense(model.embed).clone(), draft_ids, 3, 64)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norms and fc off their initial values too
    return head


def test_trained_and_inference_heads_agree_over_a_draft_chain(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, model, hf = target
    draft_ids = torch.arange(0, 300, 2)  # a pruned vocabulary: d2t maps draft i to target 2i
    trained = _random_head(model, hf, draft_ids)
    aux = default_aux_layers(model.cfg.num_layers)
    save_head(
        tmp_path / "head", trained.state_for_checkpoint(300), head_config(trained.cfg, 300, len(draft_ids), aux, {})
    )
    head = EagleHead(tmp_path / "head", model.cfg, hf, model.embed, model.lm_head, torch.float32, 64)
    assert head.version == 3 and head.aux_layers == aux and head.d2t is not None

    tokens = torch.randint(0, 300, (20,))
    kv = model.create_kv_cache(1)
    model.forward(ForwardBatch.create(tokens.numpy(), [0], [0], [20], [0]), kv, capture=aux)
    features = model.captured
    assert features is not None and features.shape == (20, 3 * model.cfg.hidden_size)
    with torch.no_grad():
        steps = trained.unroll(features, tokens, 0, 3)

    # inference: indices 0..e follow the target, then the chain feeds the true tokens as drafts
    e = 12
    head_kv = head.create_kv_cache(1, 64)
    follow = ForwardBatch.create(tokens[1 : e + 2].numpy(), [0], [0], [e + 1], [e + 1])
    out, logits = head.forward(features[: e + 1], follow.token_ids, follow, head_kv)
    torch.testing.assert_close(out, steps[0][: e + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, trained.logits(steps[0][: e + 1]).detach(), atol=1e-4, rtol=1e-4)
    out = out[-1:]
    for k in (2, 3):
        batch = ForwardBatch.create(tokens[e + k : e + k + 1].numpy(), [0], [e + k - 1], [1], [1])
        out, logits = head.forward(out, batch.token_ids, batch, head_kv)
        torch.testing.assert_close(out[0], steps[k - 1][e], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[0], trained.logits(steps[k - 1][e]).detach(), atol=1e-4, rtol=1e-4)
    assert head.to_target(torch.tensor([0, 5, 149])).tolist() == [0, 10, 298]


def test_eagle1_layout_loads_and_drafts_with_the_targets_lm_head(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, model, hf = target
    h = model.cfg.hidden_size
    torch.manual_seed(2)
    state = {
        "fc.weight": torch.randn(h, 2 * h) * 0.1,
        "fc.bias": torch.randn(h) * 0.1,
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    for name, shape in {
        "q_proj": (4 * 16, h),
        "k_proj": (2 * 16, h),
        "v_proj": (2 * 16, h),
        "o_proj": (h, 4 * 16),
    }.items():
        state[f"layers.0.self_attn.{name}.weight"] = torch.randn(shape) * 0.1
    for name, shape in {"gate_proj": (160, h), "up_proj": (160, h), "down_proj": (h, 160)}.items():
        state[f"layers.0.mlp.{name}.weight"] = torch.randn(shape) * 0.1
    save_head(
        tmp_path / "eagle1",
        state,
        {"hidden_size": h, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160},
    )
    runner = EagleRunner(tmp_path / "eagle1", model, folder, hf, max_batch_size=2, max_model_len=64)
    assert runner.head.version == 1 and runner.capture == "final" and runner.head.d2t is None

    kv = model.create_kv_cache(2)
    prompt = np.array([5, 9, 13, 7, 3], dtype=np.int32)
    batch = ForwardBatch.create(prompt, [0], [0], [5], [1])
    model.forward(batch, kv, capture=runner.capture)
    runner.follow(batch, model.captured)
    inputs = _step_inputs(prompt, draft_lens=[3])
    drafts, counts = runner.propose(inputs, np.array([42], dtype=np.int32), np.array([1], dtype=np.int32))
    assert counts.tolist() == [3] and all(0 <= t < 300 for t in drafts.tolist())
    # the same chain by hand: features 0..4 with the next tokens, then the drafts themselves
    head_kv = runner.head.create_kv_cache(1, 64)
    ids = np.array([9, 13, 7, 3, 42])
    out, logits = runner.head.forward(
        model.captured, torch.from_numpy(ids), ForwardBatch.create(ids, [0], [0], [5], [1]), head_kv
    )
    expected = [int(logits.argmax())]
    for step in range(2):
        b = ForwardBatch.create([expected[-1]], [0], [5 + step], [1], [1])
        out, logits = runner.head.forward(out, b.token_ids, b, head_kv)
        expected.append(int(logits.argmax()))
    assert drafts.tolist() == expected


def test_d2t_reads_the_target_mask(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, model, hf = target
    draft_ids = torch.tensor([0, 7, 40, 41, 299])
    trained = _random_head(model, hf, draft_ids)
    save_head(
        tmp_path / "head",
        trained.state_for_checkpoint(300),
        head_config(trained.cfg, 300, 5, default_aux_layers(2), {}),
    )
    runner = EagleRunner(tmp_path / "head", model, folder, hf, max_batch_size=1, max_model_len=64)
    bitmask = np.zeros((1, 10), dtype=np.int32)
    for allowed in (41, 299, 100):  # 100 is outside the draft vocabulary
        bitmask[0, allowed >> 5] |= 1 << (allowed & 31)
    logits = torch.zeros(1, 5)
    masks = Exchange(lambda j, rows, seqs: bitmask)
    local = post_masks(np.array([0]), np.array([1]), [[]], 0, masks)
    apply_masks(logits, local, 0, masks, runner._apply_mask)
    assert torch.isfinite(logits[0]).tolist() == [False, False, False, True, True]


def test_bad_head_folders_are_refused(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, model, hf = target
    with pytest.raises(FileNotFoundError, match="train-eagle"):
        EagleRunner(tmp_path / "missing", model, folder, hf, 1, 64)
    save_head(tmp_path / "odd", {"fc.weight": torch.zeros(4, 4)}, {})
    with pytest.raises(ValueError, match="not an EAGLE head"):
        EagleRunner(tmp_path / "odd", model, folder, hf, 1, 64)


def test_lazy_following_drafts_what_eager_following_drafts(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A row not asked for drafts keeps its positions in a backlog; when it is asked, the head runs
    them in one batch and drafts exactly what a head that followed every step drafts. So it does
    when a fused step (step_graph.py) catches the head up first (``catch_up``, before the step)."""
    folder, model, hf = target
    trained = _random_head(model, hf, torch.arange(0, 300, 2))
    save_head(
        tmp_path / "head",
        trained.state_for_checkpoint(300),
        head_config(trained.cfg, 300, 150, default_aux_layers(2), {}),
    )
    prompt = np.array([5, 9, 13, 7, 3, 11, 2], dtype=np.int32)
    steps = [
        (prompt, 0, 40),
        (np.array([40], np.int32), 7, 41),
        (np.array([41], np.int32), 8, 42),
        (np.array([42], np.int32), 9, 43),
    ]
    results = {}
    for mode in ("eager", "lazy", "caught up"):
        runner = EagleRunner(tmp_path / "head", model, folder, hf, max_batch_size=1, max_model_len=64)
        kv = model.create_kv_cache(1)
        for i, (tokens, start, produced) in enumerate(steps):
            wanted = 3 if mode == "eager" or i == len(steps) - 1 else 0
            if mode == "caught up" and i == len(steps) - 1:  # the held positions: the prompt's, then two
                assert runner.catch_up(_step_inputs(tokens, [wanted], start)) == len(prompt) + 2
                assert runner.backlog == {} and runner.catch_up(_step_inputs(tokens, [wanted], start)) == 0
            batch = ForwardBatch.create(tokens, [0], [start], [len(tokens)], [1])
            model.forward(batch, kv, capture=runner.capture)
            runner.follow(batch, model.captured)
            drafts, counts = runner.propose(
                _step_inputs(tokens, [wanted], start), np.array([produced], np.int32), np.array([1], np.int32)
            )
            assert counts.tolist() == [wanted]
        assert mode == "eager" or runner.backlog == {}
        results[mode] = drafts.tolist()
    assert results["lazy"] == results["eager"] == results["caught up"] and len(results["lazy"]) == 3


def test_a_prefill_step_without_logits_still_reaches_the_head(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A step of prefill chunks only has no logits, so the worker proposes nothing after it; the
    head still gets its positions (from the backlog) and drafts what it drafts for the prompt run
    in one step; so it does when ``catch_up`` runs them first (the held positions, the pending
    last position of a chunk with the next chunk's first token)."""
    folder, model, hf = target
    trained = _random_head(model, hf, torch.arange(0, 300, 2))
    save_head(
        tmp_path / "head",
        trained.state_for_checkpoint(300),
        head_config(trained.cfg, 300, 150, default_aux_layers(2), {}),
    )
    prompt = np.array([5, 9, 13, 7, 3, 11, 2, 17, 4], dtype=np.int32)
    results = []
    chunked = [prompt[:4], prompt[4:7], prompt[7:]]
    for chunks, catch_up in (([prompt], False), (chunked, False), (chunked, True)):
        runner = EagleRunner(tmp_path / "head", model, folder, hf, max_batch_size=1, max_model_len=64)
        kv = model.create_kv_cache(1)
        start = 0
        for i, tokens in enumerate(chunks):
            last = i == len(chunks) - 1
            if last and catch_up:  # (as before a fused step) the earlier chunks, their last position pending
                assert runner.catch_up(_step_inputs(tokens, [3], start)) == start
            batch = ForwardBatch.create(tokens, [0], [start], [len(tokens)], [int(last)])
            model.forward(batch, kv, capture=runner.capture)
            runner.follow(batch, model.captured)
            start += len(tokens)
        drafts, _ = runner.propose(
            _step_inputs(chunks[-1], [3], start - len(chunks[-1])), np.array([40], np.int32), np.array([1], np.int32)
        )
        assert runner.backlog == {}
        results.append(drafts.tolist())
    assert results[0] == results[1] == results[2] and len(results[0]) == 3


def _step_inputs(prompt: np.ndarray, draft_lens: list[int], start: int = 0) -> StepInputs:
    """One row: ``prompt`` in slot 0 from ``start``, greedy, one logits row, drafts wanted after it."""
    one = lambda dtype, value=0: np.full(1, value, dtype=dtype)  # noqa: E731
    return StepInputs(
        step=0,
        slots=one(np.int32),
        start_positions=one(np.int32, start),
        num_new_tokens=one(np.int32, len(prompt)),
        token_ids=prompt,
        num_logits=one(np.int32, 1),
        temperature=one(np.float32),
        top_k=one(np.int32),
        top_p=one(np.float32, 1.0),
        seeds=one(np.int64, -1),
        sample_index=one(np.int32),
        num_prompt_tokens=one(np.int32, len(prompt)),
        penalties=np.ones((1, 3), np.float32),
        draft_lens=np.array(draft_lens, np.int32),
        draft_masked=np.zeros(1, np.int32),
    )


class Exchange:
    """A MaskSource (worker/drafting/draft_model.py) over one call (draft index, rows, sequences) -> bitmask
    rows, made at ``take`` (nothing overlaps the forward)."""

    def __init__(self, exchange: Callable[[int, np.ndarray, list[list[int]]], np.ndarray]) -> None:
        self.exchange = exchange
        self.posted: tuple[int, np.ndarray, list[list[int]]] | None = None

    def post(self, draft_index: int, rows: np.ndarray, sequences: list[list[int]]) -> None:
        self.posted = (draft_index, rows, sequences)

    def take(self, draft_index: int) -> np.ndarray:
        posted, self.posted = self.posted, None
        assert posted is not None and posted[0] == draft_index, "take without its post"
        return self.exchange(*posted)


def test_head_memory_is_its_file_and_its_cache(target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What rank 0's memory check counts for an EAGLE head (``head_bytes``): its weight file and
    the cache it allocates; at TP > 1 also the whole embedding it reads."""
    folder, model, hf = target
    trained = _random_head(model, hf, torch.arange(0, 300, 2))
    save_head(tmp_path / "head", trained.state_for_checkpoint(300), head_config(trained.cfg, 300, 150, (0, 1, 1), {}))
    runner = EagleRunner(tmp_path / "head", model, folder, hf, max_batch_size=4, max_model_len=64)
    cache = sum(t.numel() * 4 for t in runner.kv.k + runner.kv.v)
    file = (tmp_path / "head" / "model.safetensors").stat().st_size
    assert head_bytes(tmp_path / "head", model.cfg, torch.float32, 1, 5, 64) == file + cache
    embedding = model.cfg.vocab_size * model.cfg.hidden_size * 4 * (1 if model.cfg.tie_word_embeddings else 2)
    assert head_bytes(tmp_path / "head", model.cfg, torch.float32, 2, 5, 64) == file + cache + embedding
