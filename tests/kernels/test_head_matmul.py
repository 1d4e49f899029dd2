"""kernels/head_matmul.py against torch: each head's tokens through its own matrix, for both products of the
absorbed MLA decode (w read along its rows, W_UV, and across them, W_UK transposed), odd shapes and strided x.
On CPU the kernel runs in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

hm = import_kernels("deepserve.kernels.head_matmul")

pytestmark = MARKS


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # the layer's fallback, torch.bmm, in fp32: what both the kernel and the reference must match
    return torch.bmm(x.float().transpose(0, 1), w.float().transpose(1, 2)).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,n,k", [(1, 16, 512, 128), (3, 4, 128, 512), (8, 2, 40, 64)])
def test_rows_of_w_and_transposed_w(dtype, tokens, heads, n, k):
    gen = torch.Generator().manual_seed(tokens * 1000 + n)
    x = torch.randn(tokens, heads, k + 64, generator=gen)[:, :, :k]  # a slice: strided rows, as q_nope is
    w_rows = torch.randn(heads, n, k, generator=gen) / k ** 0.5  # W_UV-like: [H, N, K], K contiguous
    w_cols = (torch.randn(heads, k, n, generator=gen) / k ** 0.5).transpose(1, 2)  # W_UK^T: N contiguous
    for w in (w_rows, w_cols):
        xd, wd = x.to(DEVICE, dtype), w.to(DEVICE, dtype)
        # the layer's choice: the kernel on CUDA tensors of one token only (it lost to torch.bmm at more)
        assert hm.head_matmul_fits(xd, wd) is (ON_GPU and tokens == 1)
        got = hm.head_matmul(xd, wd)  # the kernel takes any count
        assert got.shape == (tokens, heads, n) and got.is_contiguous() and got.dtype == dtype
        want = _bmm(xd, wd)
        torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(hm.head_matmul_ref(xd, wd).float().cpu(), want.cpu(), atol=2e-2, rtol=2e-2)


def test_what_the_kernel_refuses():
    x = torch.zeros(2, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(4, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    assert not hm.head_matmul_fits(x.cpu(), w.cpu())  # CPU tensors: the layer keeps torch.bmm
    big = torch.zeros(64, 512, 128, dtype=torch.bfloat16, device=DEVICE)  # 8 MB: V3-sized, torch.bmm's
    one = torch.zeros(1, 64, 128, dtype=torch.bfloat16, device=DEVICE)
    assert not hm.head_matmul_fits(x[:1].cpu(), w.cpu()) and not hm.head_matmul_fits(one, big)
    if ON_GPU:
        assert hm.head_matmul_fits(x[:1], w) and not hm.head_matmul_fits(x, w)  # two tokens: torch.bmm's
    strided = torch.zeros(2, 4, 256, dtype=torch.bfloat16, device=DEVICE)[..., ::2]  # K 128, stride 2
    for bad_x, bad_w in ((x[:0], w), (x.float(), w.float()), (x[..., :96], w[..., :96]),  # K not a power of two
                         (x[:, :3], w), (strided, w)):
        with pytest.raises(ValueError, match="head_matmul"):
            hm.head_matmul(bad_x, bad_w)


def test_the_mla_layer_takes_the_kernel_where_it_fits(monkeypatch):
    # layers/mla._per_head with the kernel forced on (on CPU through the interpreter) against its torch.bmm
    # path, for both products as _absorbed_decode calls them: q_nope (a slice of q) through W_UK transposed,
    # the latents through W_UV, the two views of one wkv_b weight.
    from deepserve.layers import mla

    heads, nope, value, rank = 4, 128, 128, 512
    g = torch.Generator().manual_seed(9)
    layer = mla.MLAAttention(heads, rank, nope, 64, value, 0.1)
    layer.wkv_b.weight.data = (torch.randn(heads * (nope + value), rank, generator=g) / rank ** 0.5).to(
        DEVICE, torch.bfloat16)
    w_uk, w_uv = layer._w_uk_uv()
    q_nope = torch.randn(1, heads, nope + 64, generator=g).to(DEVICE, torch.bfloat16)[..., :nope]
    latents = torch.randn(1, heads, rank, generator=g).to(DEVICE, torch.bfloat16)
    monkeypatch.setattr(mla, "HEAD_MATMUL", False)
    want = mla._per_head(q_nope, w_uk.transpose(1, 2)), mla._per_head(latents, w_uv)
    calls = []
    kernel = (lambda x, w: calls.append(1) or hm.head_matmul(x, w), hm._shapes_fit)  # fits wherever it runs
    monkeypatch.setattr(mla, "HEAD_MATMUL", True)
    monkeypatch.setattr(mla, "_head_matmul", lambda: kernel)
    got = mla._per_head(q_nope, w_uk.transpose(1, 2)), mla._per_head(latents, w_uv)
    assert len(calls) == 2
    for g_, w_ in zip(got, want, strict=True):
        assert g_.shape == w_.shape
        torch.testing.assert_close(g_.float(), w_.float(), atol=2e-2, rtol=2e-2)
