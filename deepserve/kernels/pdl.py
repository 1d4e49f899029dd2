"""Programmatic dependent launch (PDL, Hopper) for the decode step's chain of small kernels.

Why: at one token a decode step is a chain of a few hundred kernels, most of them tiny (RMSNorm of one row,
SiLU-and-mul, the split merge), each of which costs about 1-2 µs on the H200 even inside a CUDA graph
(bench/RESULTS.md: LLM-7B's 61 RMSNorms take 117-131 µs a step). A kernel launched with the programmatic
stream-serialization attribute may start once every program of the kernel before it has executed
`griddepcontrol.launch_dependents` (or exited); it then waits in `griddepcontrol.wait` for that kernel to
finish with its memory visible. So its launch, and any work on data no earlier kernel writes (weights), overlap
the kernel before.

The rule every participating kernel keeps (what makes an early start safe): before `wait` it reads only
constant memory (weights, norm weights) and writes nothing; every read of an activation, cache or block table
and every store comes after it. Dependence is then transitive: a kernel's wait returns only once the kernel
before it has finished, and that one finished only after its own wait. A kernel launched without the attribute
(cuBLAS, a torch op, a kernel that does not take part) is serialized as always; after it the attribute is
harmless, and before it a trigger has no effect.

Where the trigger goes: the tiny kernels trigger first thing (their dependents, e.g. the next GEMV, then start
and ask for their weights while the tiny kernel runs); kernels with many programs trigger after their main loop,
so a dependent's programs never take SM slots from programs that still have work.

Who takes part: the small kernels (elementwise.py's RMSNorm and SiLU-and-mul, rope_kv_store.py), the MHA/GQA decode
attention and the split merge (triton_paged_attention.py), the int4 TMA GEMV (int4_tma_gemv.py, mode 3: with this
switch every one-token GEMV of groups of 128 takes it) and the FP8 tensor-core GEMV (fp8_mma_gemv.py). Measured on
one H200 (bench/pdl_chain_probe.py and same-machine A/Bs, bench/RESULTS.md): an LLM-7B-like int4 step 1.984 ->
1.793 ms; W2 TPOT LLM-7B AWQ 2.24 -> 2.05 ms, `-q fp8` 2.78 -> 2.56, V2-Lite AWQ 2.32 -> 2.25, V3 slice FP8 2.47
-> 2.42, bf16 LLM-7B 4.37 -> 4.34. The small kernels alone, beside GEMVs that do not take part, were 2 % slower:
hence MAX_ROWS.

With DEEPSERVE_PDL_MLA_MOE (on by default; one H100, two A/B repeats each: W2 TPOT V2-Lite AWQ 2.09 -> 1.90 ms,
V2-Lite bf16 3.16 -> 3.01, the V3 FP8 slice 3.04 -> 3.02, W1 +0.8 / +0.6 / 0.0 %) the MLA and MoE paths' kernels
take part too: the MLA decode attention (triton_paged_attention.py), the absorbed head products (head_matmul.py,
weights loaded before the wait), the router's logits and the routing (moe_routing.py), the int4 routed experts' GEMV
and its SiLU (int4_moe_mma.py), the fused MoE's alignment, activation quantization and grouped GEMMs (fused_moe.py:
V3's FP8 experts, bf16 experts; the GEMMs wait first and trigger after their main loop) and the slot sum (moe_sum.py).

Switch: DEEPSERVE_PDL (read at import; on by default). Triton's interpreter runs no inline PTX, so on CPU the
kernels always compile the plain path (PDL is a constexpr, False there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepserve import envs

# Read once, when the module is imported (a launch must not reread the environment); bench/pdl_chain_probe.py
# flips it between variants in one process.
ON = bool(envs.DEEPSERVE_PDL) and not envs.TRITON_INTERPRET
# The MLA and MoE paths' kernels (MLA decode, head_matmul, router logits, routing, the int4 routed experts' GEMV,
# the fused MoE's kernels, the slot sum) take part only with DEEPSERVE_PDL_MLA_MOE as well (on by default).
MLA_MOE = bool(envs.DEEPSERVE_PDL_MLA_MOE)
# With PDL, the decode attention (MHA/GQA; MLA with MLA_MOE) asks its first tile of cache rows into L2 before the
# wait (a prefetch brings nothing into the kernel's registers, so no value is read early; the block table and
# seq_lens it reads to find the tile were written before the step's first kernel): DEEPSERVE_PDL_KV_PREFETCH, off:
# LLM-7B AWQ's W2 TPOT read +2.0 % with it (one H100, one A/B repeat).
KV_PREFETCH = bool(envs.DEEPSERVE_PDL_KV_PREFETCH)


# Launches of at most this many rows (tokens, or sequences for decode attention) take part: one-token decode steps,
# where the GEMVs take part too (int4_tma_gemv.TMA_MAX_TOKENS, fp8_mma_gemv). Larger steps run GEMMs that do not,
# and around them the small kernels' early launches only cost (bench/pdl_chain_probe.py: +2 % a step).
MAX_ROWS = 1


def wanted(t: torch.Tensor, rows: int, mla_moe: bool = False) -> bool:
    """Whether a launch of `rows` rows over t's device takes programmatic dependence: the switch is on (and
    MLA_MOE for the kernels of those paths), rows <= MAX_ROWS and t is on a Hopper GPU."""
    return ON and rows <= MAX_ROWS and (MLA_MOE or not mla_moe) and _hopper(t.get_device())


@functools.cache
def _hopper(index: int) -> bool:
    # Hopper only (sm_90), not merely sm_90+: the GEMVs that take part are Hopper kernels (mma_gemv_common.is_hopper),
    # and beside GEMVs that do not, the small kernels' early launches cost (MAX_ROWS). Not ROCm: torch reports an
    # MI300 as 9.4, and griddepcontrol is PTX. index: t.get_device(), -1 for a CPU tensor.
    return index >= 0 and torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def launch_options(on: bool) -> dict:
    """The launch keyword that asks for programmatic dependence (empty when off: the launch is as before)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def trigger(PDL: tl.constexpr):
    """Let the next kernel (if it was launched with programmatic dependence) start now."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before to finish, its memory visible. Nothing but constants is read before this."""
    if PDL:
        tl.extra.cuda.gdc_wait()

