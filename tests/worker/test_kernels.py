"""The packed CPU linear kernel against torch: every row count the engine uses (decode, draft
verification, prefill), output sizes that are not a multiple of the block, biases; a row's
result must not depend on the other rows of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from guidespec.worker import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernel is not built")


@pytest.mark.parametrize("n,k", [(960, 576), (49152 // 8, 64), (37, 100), (16, 1), (5, 33)])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 13, 70])
def test_packed_linear_matches_torch(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    packed = kernels.pack(w)
    assert isinstance(packed, kernels.PackedWeight) and packed.shape == w.shape
    torch.testing.assert_close(kernels.linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kernels.linear(x, packed, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    w = kernels.pack(torch.randn(300, 576, generator=g))
    x = torch.randn(23, 576, generator=g)
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(len(x))])
    for m in (2, 4, 6, 7, 23):
        assert torch.equal(torch.cat([kernels.linear(x[i : i + m], w) for i in range(0, len(x), m)]), alone)


def test_packed_embedding_and_unpack_give_the_weight_back() -> None:
    w = torch.randn(1000, 24)
    packed = kernels.pack(w)
    assert torch.equal(kernels.dense(packed), w)
    ids = torch.tensor([0, 15, 16, 999, 17, 17])
    assert torch.equal(kernels.embedding(ids, packed), F.embedding(ids, w))


def test_weights_the_kernel_cannot_take_stay_as_they_are() -> None:
    w16 = torch.randn(32, 8, dtype=torch.bfloat16)
    assert kernels.pack(w16) is w16
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, w16), F.linear(x, w16))
