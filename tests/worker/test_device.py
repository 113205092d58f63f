"""Placement and memory checks (worker/device.py), the Ray placement's bundles, and the device
masks' CPU path (worker/mask.py): what a GPU engine decides before it touches a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from guidespec import envs
from guidespec.config import ModelConfig
from guidespec.launch.ray_executor import placement_bundle, placement_problem, placement_strategy
from guidespec.model_files import load_hf_config
from guidespec.worker.device import MemoryPlan, check_fits, memory_plan, rank_device, resolve_device, resolve_dtype
from guidespec.worker.mask import DeviceMasks, apply_bitmask, unpack_bitmask
from guidespec.worker.model import LlamaModel
from guidespec.worker.tp import TPInfo
from guidespec.worker.worker import collective_backend
from tests.conftest import make_tiny_model

GIB = 1 << 30


def test_device_resolution() -> None:
    assert resolve_device("auto", 2, num_gpus=0) == "cpu"
    assert resolve_device("auto", 2, num_gpus=2) == "cuda"
    assert resolve_device("cpu", 4, num_gpus=8) == "cpu"
    assert resolve_device("cuda", 0, num_gpus=0) == "cuda"  # Ray ranks: Ray places them
    with pytest.raises(ValueError, match="needs as many GPUs; torch sees 1 GPU"):
        resolve_device("cuda", 2, num_gpus=1)
    with pytest.raises(ValueError, match="torch sees no GPU"):
        resolve_device("cuda", 1, num_gpus=0)
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu", 1, num_gpus=0)
    assert [resolve_dtype("auto", d) for d in ("cuda", "cpu")] == ["bfloat16", "float32"]
    assert resolve_dtype("float16", "cuda") == "float16"
    assert [rank_device("cuda", i, num_gpus=4) for i in (0, 3, None)] == ["cuda:0", "cuda:3", "cuda:0"]
    assert rank_device("cpu", 1) == "cpu"


def test_ranks_share_one_gpu_where_their_collectives_run_over_gloo() -> None:
    """Two local ranks and one GPU: refused unless the ranks share it (GUIDESPEC_TP_BACKEND=gloo),
    and then both on cuda:0 (four ranks on two GPUs: 0, 1, 0, 1)."""
    with pytest.raises(ValueError, match="needs as many GPUs"):
        resolve_device("cuda", 2, num_gpus=1)
    assert resolve_device("cuda", 2, num_gpus=1, share_gpus=True) == "cuda"
    assert resolve_device("auto", 2, num_gpus=1, share_gpus=True) == "cuda"
    with pytest.raises(ValueError, match="needs a GPU; torch sees no GPU"):
        resolve_device("cuda", 2, num_gpus=0, share_gpus=True)
    assert [rank_device("cuda", i, num_gpus=1) for i in range(2)] == ["cuda:0", "cuda:0"]
    assert [rank_device("cuda", i, num_gpus=2) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_the_collective_backend_of_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL for a CUDA rank, gloo for a CPU rank; GUIDESPEC_TP_BACKEND=gloo puts CUDA ranks on gloo
    (eagerly: a CUDA graph cannot hold its collectives); NCCL never on the CPU."""
    monkeypatch.delenv("GUIDESPEC_TP_BACKEND", raising=False)
    assert envs.tp_backend() is None
    assert [collective_backend(d, envs.tp_backend(), captured=True) for d in ("cuda", "cpu")] == ["nccl", "gloo"]
    monkeypatch.setenv("GUIDESPEC_TP_BACKEND", "gloo")
    assert [collective_backend(d, envs.tp_backend()) for d in ("cuda", "cpu")] == ["gloo", "gloo"]
    with pytest.raises(ValueError, match="run eagerly"):
        collective_backend("cuda", envs.tp_backend(), captured=True)
    monkeypatch.setenv("GUIDESPEC_TP_BACKEND", "nccl")
    assert collective_backend("cuda", envs.tp_backend(), captured=True) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA ranks"):
        collective_backend("cpu", envs.tp_backend())
    monkeypatch.setenv("GUIDESPEC_TP_BACKEND", "mpi")
    with pytest.raises(ValueError, match="must be nccl or gloo"):
        envs.tp_backend()


def test_memory_plan_counts_the_shard(tmp_path: Path) -> None:
    """The plan's weight bytes are those the model really loads (TP=1 and rank 0 of 2)."""
    folder = make_tiny_model(tmp_path / "m", "llama")
    hf = load_hf_config(folder)
    cfg = ModelConfig.from_hf(hf)
    for tp in (TPInfo(0, 1), TPInfo(0, 2)):
        model = LlamaModel(cfg, tp, torch.float32, max_model_len=64)
        model.load(folder, hf, show_progress=False)
        tensors = [model.embed, model.final_norm] + [w for layer in model.layers for w in layer.values()]
        if model.lm_head is not model.embed:
            tensors.append(model.lm_head)
        loaded = sum(int(np.prod(t.shape)) * 4 for t in tensors)
        plan = memory_plan(cfg, torch.float32, tp.size, num_slots=3, max_model_len=64, max_step_rows=8)
        assert plan.weights == loaded
        kv = model.create_kv_cache(3)
        assert plan.kv_cache == sum(t.numel() * 4 for t in kv.k + kv.v)


def test_what_does_not_fit_is_said_with_numbers() -> None:
    plan = MemoryPlan(weights=2 * GIB, kv_cache=8 * GIB, activations=1 * GIB)
    check_fits(
        plan,
        free_bytes=80 * GIB,
        total_bytes=80 * GIB,
        utilization=0.9,
        num_slots=16,
        max_model_len=4096,
        device_name="H100",
    )
    with pytest.raises(ValueError, match=r"KV cache does not fit H100.*--max-batch-size 13 fits"):
        check_fits(
            plan,
            free_bytes=10 * GIB,
            total_bytes=80 * GIB,
            utilization=0.9,
            num_slots=16,
            max_model_len=4096,
            device_name="H100",
        )
    with pytest.raises(ValueError, match="the model does not fit"):
        check_fits(
            plan,
            free_bytes=2 * GIB,
            total_bytes=80 * GIB,
            utilization=0.9,
            num_slots=16,
            max_model_len=4096,
            device_name="H100",
        )
    with_drafter = MemoryPlan(weights=2 * GIB, kv_cache=8 * GIB, activations=1 * GIB, drafter=2 * GIB)
    with pytest.raises(ValueError, match=r"weights \(the drafter: 2.00 GiB more\).*--max-batch-size 9 fits"):
        check_fits(with_drafter, 10 * GIB, 80 * GIB, 0.9, 16, 4096, "H100")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        check_fits(plan, 80 * GIB, 80 * GIB, 1.5, 16, 4096, "H100")


def test_ray_placement_bundles() -> None:
    assert placement_bundle(4, 1) == {"CPU": 4.0, "GPU": 1.0} and placement_bundle(2, 0) == {"CPU": 2.0}
    assert [placement_strategy(p, 1) for p in ("pack", "spread")] == ["STRICT_PACK", "STRICT_SPREAD"]
    assert [placement_strategy(p, 0) for p in ("pack", "spread")] == ["PACK", "SPREAD"]
    assert placement_problem(2, {"CPU": 4.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 2.0}) is None
    problem = placement_problem(4, {"CPU": 4.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 2.0})
    assert problem is not None and "4 ranks x 1 GPU need 4 GPUs, the cluster has 2" in problem


def test_device_masks_apply_on_the_cpu_as_numpy_says() -> None:
    rng = np.random.default_rng(0)
    vocab, words = 100, 4
    logits = torch.from_numpy(rng.normal(size=(6, vocab)).astype(np.float32))
    bitmask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    rows = np.array([4, 0, 2])
    masks = DeviceMasks("cpu", max_rows=8, num_words=words, arena_buffers=[bitmask])
    assert masks.registered == [] and not masks.is_pinned(bitmask)  # nothing is page-locked on the CPU
    assert masks.upload(bitmask).data_ptr() == bitmask.__array_interface__["data"][0]  # in place
    expected = logits.numpy().copy()
    bits = (bitmask.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = bits.reshape(3, -1)[:, :vocab].astype(bool)
    for i, r in enumerate(rows):
        expected[r][~allowed[i]] = -np.inf
    masks.apply(logits, rows, bitmask)
    np.testing.assert_array_equal(logits.numpy(), expected)
    masks.close()


def test_apply_bitmask_takes_device_tensors() -> None:
    logits = torch.zeros(3, 40)
    bitmask = torch.tensor([[0b101, 1 << 7]], dtype=torch.int32)
    apply_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, 39]
    assert bool(torch.isfinite(logits[[0, 2]]).all())
    assert unpack_bitmask(bitmask, 40)[0].nonzero().flatten().tolist() == [0, 2, 39]


def test_the_kv_pool_is_sized_by_tokens_or_memory_and_holds_one_sequence_at_least(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from guidespec.worker import device

    plan = MemoryPlan(weights=GIB, kv_cache=0, activations=GIB)
    per_token = 46_080  # SmolLM2-135M, fp32: 30 layers x 2 x 3 heads x 64 x 4 bytes
    assert device.kv_pool_blocks(plan, per_token, 16, 8192, 256, "cpu", 0.9, kv_cache_tokens=100_000) == 6250
    monkeypatch.setattr(device, "_cpu_available_bytes", lambda: 20 * GIB)  # 40%: 8 GiB, ~186k tokens
    assert device.kv_pool_blocks(plan, per_token, 16, 8192, 256, "cpu", 0.9) == 8 * GIB // (per_token * 16)
    assert device.kv_pool_blocks(plan, per_token, 16, 8192, 256, "cpu", 0.9, tp_size=2) == 4 * GIB // (per_token * 16)
    assert device.kv_pool_blocks(plan, per_token, 16, 2048, 4, "cpu", 0.9) == 4 * 128  # no more than 4 slots need
    monkeypatch.setattr(device, "_cpu_available_bytes", lambda: GIB // 4)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        device.kv_pool_blocks(plan, per_token, 16, 8192, 256, "cpu", 0.9)
