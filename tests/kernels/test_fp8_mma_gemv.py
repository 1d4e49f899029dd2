"""The tensor-core FP8 GEMV (kernels/fp8_mma_gemv.py): its lane-by-lane data movement and inline PTX replayed in
torch (kernels/fp8_mma_ref.py) against x times the dequantized weight (fp8_ref), the widening against torch's
own e4m3 conversion for every code, when the kernel is taken, and its sm_90 compile. The kernel itself runs
only on a GPU (Gluon has no CPU interpreter): bench/fp8_gemv_probe.py checks it there against the same product,
as does the Hopper-only test at the end of this file."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from deepserve.kernels import fp8_mma_gemv
from deepserve.kernels import fp8_ref as ref
from deepserve.kernels.fp8_mma_ref import fp8_mma_gemv_replay
from deepserve.kernels.ptx_replay import run_block_asm
from tests.kernels.triton_setup import DEVICE

FP8 = torch.float8_e4m3fn


def block_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q [N, K] e4m3, scale_inv) whose blocks differ in magnitude by up to 10^4: a scale read from the wrong
    block is far outside the tolerance."""
    gen = torch.Generator().manual_seed(seed)
    (bn, bk), nb, kb = block, -(-n // block[0]), -(-k // block[1])
    magnitude = 10 ** (torch.rand(nb, kb, generator=gen) * 4 - 2)
    w = torch.randn(n, k, generator=gen) * magnitude.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return ref.quantize_weight_block(w, block)


def channel_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 10 ** (torch.rand(n, 1, generator=gen) * 4 - 2)  # rows differ by up to 10^4: a wrong row's scale shows
    return ref.quantize_weight_per_channel(torch.randn(n, k, generator=gen) * rows)


def dequantized_product(x, w_q, scale, block, bias=None) -> torch.Tensor:
    w = ref.dequantize_weight_block(w_q, scale, block) if block else w_q.double() * scale.double()[:, None]
    out = x.double() @ w.double().T
    return (out if bias is None else out + bias.double()).float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("m, n, k, block, dtype, words", [
    (1, 16, 128, None, torch.bfloat16, 8),
    (3, 40, 256, None, torch.float16, 4),  # N not a multiple of 16: the last tile's rows wrap
    (8, 32, 256, (16, 128), torch.bfloat16, 4),  # a scale a tile row and a 128-input block, 2 rounds a block
    (2, 48, 384, (32, 128), torch.float16, 8),
    (5, 24, 256, (128, 128), torch.bfloat16, 8),  # DeepSeek-V3's blocks, one block row for every tile
])
def test_the_kernels_asm_replayed_lane_by_lane_equals_the_dequantized_product(m, n, k, block, dtype, words):
    w_q, scale = block_weight(n, k, block, seed=n + k) if block else channel_weight(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n) if m == 3 else None
    want = dequantized_product(x, w_q, scale, block, bias)
    got = fp8_mma_gemv_replay(x, w_q, scale, block, bias, words=words)
    assert rel_err(got, want) < 1e-5  # exact products, fp32 sums


@pytest.mark.parametrize("wrong, right", [
    ("cvt.rn.bf16x2.f32 a0, f1, f0", "cvt.rn.bf16x2.f32 a0, f0, f1"),  # a pair's halves swapped
    ("cvt.rn.f16x2.e4m3x2 p, q1", "cvt.rn.f16x2.e4m3x2 p, q0"),  # bytes 0, 1 widened twice, bytes 2, 3 never
    ("{a0, a1, a2, a3}", "{a0, a2, a1, a3}")])  # the A fragment's order
def test_the_replay_fails_for_a_wrong_asm(wrong, right):
    # the replay runs the kernel's own asm text: a changed operand gives a wrong product
    asm = fp8_mma_gemv.WORD_ASM_BF16.value
    assert wrong in asm
    w_q, scale = channel_weight(16, 128, seed=3)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = dequantized_product(x, w_q, scale, None)
    bad = fp8_mma_gemv_replay(x, w_q, scale, None, asm=asm.replace(wrong, right, 1))
    assert rel_err(bad, want) > 1e-3


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_widening_is_exact_for_every_e4m3_code(dtype):
    # every byte value but the two NaNs, in each of a word's four positions, against torch's own conversion
    widen = fp8_mma_gemv._widen_bf16 if dtype == "bf16" else fp8_mma_gemv._widen_f16
    asm = "{\n.reg .b16 q0, q1, h0, h1;\n.reg .b32 p;\n.reg .f32 f0, f1;" + widen("$4", "$0", "$1") + "\n}"
    target = torch.bfloat16 if dtype == "bf16" else torch.float16
    codes = [c for c in range(256) if c not in (0x7F, 0xFF)]
    for shift in range(4):
        words = [c << (8 * shift) | 0xB8 << (8 * ((shift + 1) % 4)) for c in codes]  # 0xB8: -1.0 beside it
        got = []
        for start in range(0, len(words), 32):
            batch = (words[start: start + 32] + [0] * 32)[:32]
            got += [lo | hi << 32 for lo, hi, _, _ in run_block_asm(asm, [{"$4": w, "$2": 0.0, "$3": 0.0}
                                                                        for w in batch])]
        raw = torch.tensor(words, dtype=torch.int64)
        want = torch.stack([(raw >> (8 * b) & 0xFF).to(torch.uint8).view(FP8).to(target) for b in range(4)], 1)
        bits = (want.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
        assert got[: len(words)] == [h0 | h1 << 16 | (h2 | h3 << 16) << 32 for h0, h1, h2, h3 in bits], shift


class _OnHopper:
    """Stands for a CUDA tensor on a Hopper GPU (no GPU here): what mma_gemv_supported reads of x."""
    is_cuda, device = True, torch.device("cuda", 0)

    def __init__(self, m: int, k: int, dtype: torch.dtype = torch.bfloat16, stride: int = 1, offset: int = 0,
                 row_stride: int | None = None):
        self.shape, self.dtype, self._stride, self._offset = (m, k), dtype, stride, offset
        self._row_stride = k if row_stride is None else row_stride

    def stride(self, dim: int) -> int:
        return self._stride if dim == 1 else self._row_stride

    def data_ptr(self) -> int:
        return (1 << 20) + self._offset * 2


def test_it_is_taken_only_where_it_applies(monkeypatch):
    w = torch.zeros(64, 4096, dtype=FP8)
    assert not fp8_mma_gemv.mma_gemv_supported(torch.randn(1, 4096, dtype=torch.bfloat16), w, None)  # CPU
    monkeypatch.setattr(fp8_mma_gemv, "_is_hopper", lambda device: True)
    monkeypatch.setattr(fp8_mma_gemv, "INTERPRET", False)  # the CPU tests run under Triton's interpreter
    supported = fp8_mma_gemv.mma_gemv_supported
    assert supported(_OnHopper(1, 4096), w, None)
    assert supported(_OnHopper(8, 4096, torch.float16), w, (128, 128))
    assert supported(_OnHopper(2, 4096), w, (16, 256))
    assert not supported(_OnHopper(9, 4096), w, None)  # more tokens than the mma's 8 columns
    assert not supported(_OnHopper(1, 4096, torch.float32), w, None)
    assert not supported(_OnHopper(1, 4096, stride=2), w, None)
    assert not supported(_OnHopper(1, 4096, offset=1), w, None)  # x read as int32 pairs: aligned only
    assert not supported(_OnHopper(2, 4096, row_stride=4100), w, None)  # rows 16-byte aligned only
    assert supported(_OnHopper(2, 4096, row_stride=4104), w, None)
    wide = torch.zeros(64, 4104, dtype=FP8)
    assert not supported(_OnHopper(1, 4096), wide[:, :4096], None)  # weight rows 16-byte aligned only
    flat = torch.zeros(64 * 4096 + 16, dtype=FP8)
    assert supported(_OnHopper(1, 4096), flat[16:].view(64, 4096), None)
    assert not supported(_OnHopper(1, 4096), flat[8: 8 + 64 * 4096].view(64, 4096), None)  # 8-byte aligned
    assert not supported(_OnHopper(1, 4096), torch.zeros(0, 4096, dtype=FP8), None)  # no rows
    assert not supported(_OnHopper(1, 0), torch.zeros(64, 0, dtype=FP8), None)  # no inputs
    assert not supported(_OnHopper(1, 4096), w, (8, 128))  # a scale block smaller than a 16-row tile
    assert not supported(_OnHopper(1, 4096), w, (128, 64))  # a scale block narrower than a round
    odd = torch.zeros(64, 4160, dtype=FP8)
    assert not supported(_OnHopper(1, 4160), odd, None)  # K not a multiple of 128
    assert not supported(_OnHopper(1, 2048), w[:, :2048].t().contiguous().t(), None)  # weight not row-major
    assert not supported(_OnHopper(1, 4096), torch.zeros(64, 4096, dtype=torch.float8_e5m2), None)
    monkeypatch.setattr(fp8_mma_gemv, "INTERPRET", True)
    assert not supported(_OnHopper(1, 4096), w, None)
    cfg = fp8_mma_gemv.Fp8MmaGemvConfig(one_split=False)
    # split-K: no split empty, about programs_per_sm programs an SM, at least a round a warp
    for n, k in ((4096, 4096), (22016, 4096), (4096, 11008), (576, 7168), (16, 65536), (80, 256)):
        warps, s = fp8_mma_gemv.mma_launch_shape(n, k, cfg, 132)
        rounds = k // (16 * cfg.words)
        per = -(-rounds // s)
        assert warps == cfg.num_warps
        assert 1 <= s <= min(rounds, 16) and (s - 1) * per < rounds and per >= min(cfg.num_warps, rounds)
    # one split where the tiles alone fill the SMs (<= 24 warps an SM, <= 8 a program), split-K where they
    # come to < 6 warps an SM over a long K (V3's kv_a and q_a), whatever is asked explicitly as asked
    shape = functools.partial(fp8_mma_gemv.mma_launch_shape, cfg=fp8_mma_gemv.Fp8MmaGemvConfig(one_split=True),
                              num_sms=132)
    assert shape(12288, 4096) == (4, 1) and shape(4096, 4096) == (8, 1) and shape(22016, 4096) == (2, 1)
    assert shape(36864, 7168) == (1, 1) and shape(7168, 2048) == (4, 1)
    assert shape(576, 7168)[1] > 1 and shape(1536, 7168)[1] > 1
    assert shape(576, 1024) == (8, 1)  # 8 rounds: two a warp
    assert fp8_mma_gemv.mma_launch_shape(4096, 4096, fp8_mma_gemv.Fp8MmaGemvConfig(num_warps=16, split_k=1),
                                         132) == (16, 1)


def test_bad_scales_and_configs_are_refused():
    w_q, scale = channel_weight(16, 128, seed=0)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="words must be 4 or 8"):
        fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale, None, cfg=fp8_mma_gemv.Fp8MmaGemvConfig(words=2))
    with pytest.raises(ValueError, match=r"the scale must be float32 \(16,\)"):
        fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale.half(), None)
    with pytest.raises(ValueError, match=r"the scale must be float32 \(1, 1\)"):
        fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale, (128, 128))
    with pytest.raises(ValueError, match="scale blocks whole 16-row tiles and 128-input rounds"):
        fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale.view(16, 1).repeat(1, 2), (1, 64))


def test_fp8_linears_take_it_up_to_its_token_limit(monkeypatch):
    from deepserve.kernels import fp8

    taken = []
    monkeypatch.setattr(fp8, "mma_gemv_supported", lambda x2, w_q, block: True)
    monkeypatch.setattr(fp8, "fp8_mma_gemv", lambda x2, w_q, s, block, bias: taken.append((x2.shape[0], block))
                        or x2.new_zeros(x2.shape[0], w_q.shape[0]))
    monkeypatch.setattr(fp8, "MMA_GEMV_MAX_M", 8)
    # On the test device: 9 tokens run the other kernels for real (compiled on a GPU, interpreted on a CPU).
    w_q, scale = (t.to(DEVICE) for t in channel_weight(16, 128, seed=0))
    wb, sb = (t.to(DEVICE) for t in block_weight(16, 128, (128, 128), seed=0))
    for m in (1, 8, 9):
        fp8.channel_fp8_cuda(torch.randn(m, 128, device=DEVICE), w_q, scale)
        fp8.block_fp8_linear(torch.randn(m, 128, device=DEVICE), wb, sb, (128, 128))
    assert taken == [(1, None), (1, (128, 128)), (8, None), (8, (128, 128))]  # 9 tokens: the other kernels
    monkeypatch.setattr(fp8, "MMA_GEMV_MAX_M", 0)
    fp8.channel_fp8_cuda(torch.randn(1, 128, device=DEVICE), w_q, scale)
    assert len(taken) == 4


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from deepserve.kernels.fp8_mma_gemv import _fp8_mma_gemv_kernel as K
sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ws_ptr": "*fp32", "out_ptr": "*bf16",
       "bias_ptr": "*bf16", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "rounds_per_split": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_sk": "i32"}
aligned = ["x_ptr", "w_ptr", "s_ptr", "ws_ptr", "out_ptr", "bias_ptr", "lock_ptr", "N", "K", "stride_xm", "stride_wn"]
for f16, per_channel, fused, prefetch, words, evict, direct, pdl in (
        (False, True, True, True, 8, "evict_first", False, False),
        (True, False, False, False, 4, "", False, True),
        (False, False, True, True, 4, "", False, False),
        (True, True, True, True, 8, "evict_first", False, False),
        (False, False, False, True, 8, "evict_first", True, False),
        (False, True, False, True, 8, "evict_first", True, True)):
    ce = dict(GROUP_N=16 if per_channel else 128, GROUP_K=128, PER_CHANNEL=per_channel, F16=f16, HAS_BIAS=True,
              FUSED_SUM=fused, NUM_WARPS=2, MAX_SPLITS=1 if direct else 8, PREFETCH=prefetch, WORDS=words,
              EVICT=evict, DIRECT=direct, PDL=pdl)
    s = dict(sig, x_ptr="*fp16", out_ptr="*fp16", bias_ptr="*fp16") if f16 else sig
    src = GluonASTSource(fn=K, signature=s | dict.fromkeys(ce, "constexpr"), constexprs=ce,
                         attrs={(K.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=2)).asm["ptx"]
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    print(f16, words, ptx.count("mma.sync.aligned.m16n8k16"), ptx.count("ld.global.v4"),
          ptx.count("cvt.rn.f16x2.e4m3x2"), fused, direct, ptx.count("atom.") + ptx.count("fence."), pdl, prefetch,
          int(wait >= 0), int(trigger > wait >= 0), int(0 <= ptx.find("ld.global") < wait))
"""


def test_the_kernel_compiles_for_hopper():
    # in a fresh interpreter without TRITON_INTERPRET (the interpreter patches triton.language in its process)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 6
    for f16, words, mmas, vector_loads, widens, fused, direct, syncs, pdl, prefetch, wait, trigger_after, load_first \
            in lines:
        # programmatic dependence (kernels/pdl.py): a wait, the trigger after it; with prefetch the first round's
        # weights are asked for before the wait
        assert wait == trigger_after == str(int(pdl == "True")), (pdl, wait, trigger_after)
        assert load_first == str(int(pdl == prefetch == "True")), (pdl, prefetch, load_first)
        # a round: `words` mmas, each widening 2 words of 4 bytes (2 cvt each); 16-byte loads of weights and x
        assert int(mmas) >= int(words) and int(widens) >= 4 * int(words), (f16, words, mmas, widens)
        assert int(vector_loads) >= 2, (f16, words, vector_loads)
        # the fused split sum counts with an atomic behind fences; one split (DIRECT) stores with neither
        assert (int(syncs) > 0) == (fused == "True"), (fused, direct, syncs)


def _on_hopper() -> bool:
    return torch.cuda.is_available() and not fp8_mma_gemv.INTERPRET and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on a Hopper GPU only")
@pytest.mark.parametrize("m, n, k, block, dtype, bias", [
    (1, 1000, 4096, None, torch.bfloat16, True),  # rows wrap in the last tile; several K splits
    (3, 576, 7168, (128, 128), torch.bfloat16, False),
    (8, 4096, 11008, None, torch.float16, False),
    (5, 512, 384, (128, 256), torch.bfloat16, True),  # K 1.5 scale blocks: the last block partial
])
def test_the_kernel_on_the_gpu_equals_the_dequantized_product(m, n, k, block, dtype, bias):
    w_q, scale = block_weight(n, k, block, seed=n) if block else channel_weight(n, k, seed=n)
    w_q, scale = w_q.cuda(), scale.cuda()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype).cuda() if bias else None
    assert fp8_mma_gemv.mma_gemv_supported(x, w_q, block)
    want = dequantized_product(x.cpu(), w_q.cpu(), scale.cpu(), block, None if b is None else b.cpu().float())
    got = fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale, block, b).float().cpu()
    assert rel_err(got, want) < 4e-3  # the output rounded to 16 bits
    if block is not None:  # a column-major scale tensor: its strides are honoured
        got_t = fp8_mma_gemv.fp8_mma_gemv(x, w_q, scale.t().contiguous().t(), block, b).float().cpu()
        assert torch.equal(got_t, got)
