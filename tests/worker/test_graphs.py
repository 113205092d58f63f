"""The graph runner's padded, fixed-shape forward equals the ordinary forward (on the CPU, where
it runs eagerly: the same buffers, buckets and padding a CUDA graph replays), and its buckets."""

from __future__ import annotations

import pytest
import torch

from guidespec.config import ModelConfig
from guidespec.model_files import load_hf_config
from guidespec.worker.graphs import GraphKey, GraphRunner, batch_bucket, key_bucket, tokens_bucket
from guidespec.worker.forward_batch import ForwardBatch
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from tests.conftest import make_tiny_model

MAX_BATCH = 6


def test_buckets() -> None:
    assert [batch_bucket(b, 16) for b in (1, 2, 3, 5, 9, 16, 17, 0)] == [1, 2, 4, 8, 16, 16, None, None]
    assert batch_bucket(5, 6) == 6 and batch_bucket(3, 6) == 4  # the max batch size is a bucket
    assert [key_bucket(n, 2048) for n in (1, 256, 257, 1000, 2048)] == [256, 256, 512, 1024, 2048]
    assert key_bucket(300, 300) == 300
    assert [tokens_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33, 0)] == [1, 2, 4, 8, 8, 16, 32, 32, None, None]
    assert tokens_bucket(5, max_tokens_per_row=6) == 6


# the families' switches too: q/k norms, Gemma 3's norms, GELU, two RoPE tables and windows (of 5 and 6
# keys: the steps below run past them), Phi-3's partial rotary
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "phi3", "mistral_window"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    hf = load_hf_config(folder)
    model = LlamaModel(ModelConfig.from_hf(hf), TPInfo(), torch.float32, max_model_len=300)
    model.load(folder, hf, show_progress=False)
    return model


def _steps() -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """(slots, starts, new tokens per row, logits per row) after a prefill of every slot to 20
    tokens: decode, decode of a padded batch on scattered slots, verify with mixed row lengths,
    rows padded to their tokens' bucket."""
    return [
        ([0, 1, 2, 3], [20, 20, 20, 20], [1, 1, 1, 1], [1, 1, 1, 1]),
        ([4, 0, 2], [20, 21, 21], [1, 1, 1], [1, 1, 1]),
        ([1, 3, 5], [21, 21, 20], [4, 1, 3], [4, 1, 3]),
        ([5], [23], [2], [1]),
        ([0, 2], [22, 22], [3, 3], [3, 1]),  # 3 tokens a row, run in a graph of 4
    ]


def test_padded_forward_equals_the_ordinary_forward(model: LlamaModel) -> None:
    gen = torch.Generator().manual_seed(0)
    eager_kv, graph_kv = model.create_kv_cache(MAX_BATCH + 1), model.create_kv_cache(MAX_BATCH + 1)
    prefill = ForwardBatch.create(
        torch.randint(0, 300, (MAX_BATCH * 20,), generator=gen),
        list(range(MAX_BATCH)),
        [0] * MAX_BATCH,
        [20] * MAX_BATCH,
        [1] * MAX_BATCH,
    )
    model.forward(prefill, eager_kv)
    model.forward(prefill, graph_kv)
    # with an EAGLE-3 head's features: the inputs of layers 0 and 1 (the second one twice)
    features = (0, 1, 1)
    runner = GraphRunner(model, graph_kv, MAX_BATCH, capture=False, features=features)
    for slots, starts, counts, logits in _steps():
        tokens = torch.randint(0, 300, (sum(counts),), generator=gen)
        batch = ForwardBatch.create(tokens, slots, starts, counts, logits)
        key = runner.plan(batch)
        assert key is not None and key.batch == batch_bucket(len(slots), MAX_BATCH) and key.key_length == 256
        expected = model.forward(batch, eager_kv, capture=features)
        expected_features = model.captured
        torch.testing.assert_close(runner.run(batch, key), expected, atol=1e-5, rtol=1e-5)
        assert expected_features is not None and model.captured is not None
        torch.testing.assert_close(model.captured, expected_features, atol=1e-5, rtol=1e-5)
    assert runner.eager_runs == len(_steps())
    # the real slots' keys and values are the same (padding wrote only the scratch slot)
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(graph_kv.k[layer][:, :MAX_BATCH, :24], eager_kv.k[layer][:, :MAX_BATCH, :24])
        torch.testing.assert_close(graph_kv.v[layer][:, :MAX_BATCH, :24], eager_kv.v[layer][:, :MAX_BATCH, :24])


def test_steps_outside_the_buckets_run_eagerly(model: LlamaModel) -> None:
    runner = GraphRunner(model, model.create_kv_cache(MAX_BATCH + 1), MAX_BATCH, capture=False)
    prefill = ForwardBatch.create(list(range(40)), [0], [0], [40], [1])
    assert runner.plan(prefill) is None  # 40 tokens in a row: a prefill chunk
    near_end = ForwardBatch.create([1, 2], [0], [298], [2], [2])
    assert runner.plan(near_end) == GraphKey(1, 2, 300)
    near_end = ForwardBatch.create([1, 2, 3], [0], [297], [3], [3])  # padded to 4 tokens past the end
    assert runner.plan(near_end) == GraphKey(1, 4, 300)
    big = GraphRunner(model, model.create_kv_cache(129), 128, capture=False)
    rows = ForwardBatch.create([1] * 17 * 65, list(range(65)), [0] * 65, [17] * 65, [1] * 65)
    assert big.plan(rows) is None  # 128 rows x 32 tokens: more than MAX_GRAPH_TOKENS
    with pytest.raises(ValueError, match="scratch slot"):
        GraphRunner(model, model.create_kv_cache(MAX_BATCH), MAX_BATCH, capture=False)
