#!/usr/bin/env bash
# The H200 gate in one device call (bench/gate.py says what it runs and how it judges):
#   device run: GATE_COMMIT=$(git describe --always --dirty) bash bench/gate.sh   (the commit, from this
#   side, "-dirty" when the tree has uncommitted changes: the device copy of the tree may carry a stale .git)
# The table comes last; $OUT gets gate.json, baseline-candidate.json (copy it to bench/baseline.json when
# the figures are accepted; on another GPU to the bench/baseline-<gpu>.json the table names) and gate-logs.tgz
# (every step's log).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gate-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
# Start-up trace 1 spent 8.6 s of a 40 s start compiling imports from source: this machine's Python
# environment has no cached bytecode for most packages and the processes wrote none. An installed server
# has it (pip byte-compiles; deploy/Dockerfile), so the gate's processes get a writable bytecode cache:
# the first process of a call compiles, the later ones read. Printed first: what the machine had.
python3 -c 'import os, sys, torch, importlib.util as u; print("bytecode before the gate: PYTHONDONTWRITEBYTECODE =", os.environ.get("PYTHONDONTWRITEBYTECODE"), "| site-packages writable:", os.access(os.path.dirname(os.path.dirname(torch.__file__)), os.W_OK), "| torch bytecode cached:", os.path.exists(u.cache_from_source(torch.__file__)))'
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/deepserve-pycache}
unset PYTHONDONTWRITEBYTECODE
# Fill it before anything is timed, so no measured process (an A/B's first variant) pays the compiling.
python3 -c 'import torch._dynamo, torch._inductor.compile_fx, triton, deepserve.entrypoints.llm, deepserve.runner.model_runner
from transformers import AutoConfig
for t in ("llama", "qwen2", "deepseek_v2", "deepseek_v3"): AutoConfig.for_model(t)' >/dev/null 2>&1 || true
if [ "$1" = ab ]; then  # same-machine A/B of the trees bench/ab_trees.sh exported (carry .ab): bench/ab.py
  shift; python3 bench/ab.py --out /tmp/gate "$@"; rc=$?
  cp /tmp/gate/ab.json "$OUT"/ 2>/dev/null; tar -czf "$OUT/ab-logs.tgz" -C /tmp/gate . 2>/dev/null; exit $rc
fi
SUITE=all
case "$1" in all|fp8|kv|kv-long|int4|structured|switches) SUITE=$1; shift;; esac  # bash bench/gate.sh fp8 | int4 | kv ...: that suite (bench/gate.py)
python3 bench/gate.py "$SUITE" --out /tmp/gate "$@"
rc=$?
cp /tmp/gate/gate.json /tmp/gate/baseline-candidate.json "$OUT"/ 2>/dev/null
tar -czf "$OUT/gate-logs.tgz" -C /tmp/gate . 2>/dev/null
exit $rc
