"""The sm_90 machine code of the one-token int4 GEMV's main loop, counted by instruction, with no GPU: the
kernel compiled by Triton for sm_90 as int4_gemv.default_gemv_config(1) launches it (64 x 128 tiles,
prefetching, the fused split sum, bf16 inputs), disassembled with the nvdisasm Triton ships, and the
instructions between the loop's label and its backward branch counted, per numerics (factored, magic).

    python bench/sass_loop.py > OUT.txt
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from deepserve.kernels.int4_gemv import _w4a16_gemv_kernel  # noqa: E402

SIGNATURE = {"a_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "g_ptr": "*bf16",
             "c_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16", "lock_ptr": "*i32", "M": "i32", "N": "i32",
             "K": "i32", "split_k": "i32", "stride_am": "i32", "stride_qn": "i32", "stride_sn": "i32"}


def sass(magic: bool) -> str:
    constexprs = dict(BITS=4, GROUP=128, HAS_G_IDX=False, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, EVEN_K=True,
                      FACTORED=True, MAGIC=magic, PREFETCH=True, PARTIAL=True, HAS_BIAS=False, FUSED_SUM=True,
                      INTERPRETED=False, MAX_SPLITS=8)
    signature = SIGNATURE | dict.fromkeys(constexprs, "constexpr")
    source = triton.compiler.ASTSource(fn=_w4a16_gemv_kernel, signature=signature, constexprs=constexprs)
    options = dict(num_warps=4, num_stages=3)
    cubin = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_counts(code: str) -> collections.Counter:
    """Instructions of the loop that branches back furthest (the K loop: the longest backward branch)."""
    lines = code.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    best = None
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and target.group(1) in labels and labels[target.group(1)] < i:
            span = (labels[target.group(1)], i)
            best = span if best is None or span[1] - span[0] > best[1] - best[0] else best
    ops = [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line) for line in lines[best[0]:best[1] + 1]]
    return collections.Counter(op.group(1) for op in ops if op)


if __name__ == "__main__":
    for magic in (False, True):
        counts = loop_counts(sass(magic))
        print(f"{'magic' if magic else 'factored'}: {sum(counts.values())} instructions a thread per K tile;",
              ", ".join(f"{op} {n}" for op, n in counts.most_common(12)))
