#!/usr/bin/env bash
# Run 11 of bench/RESULTS.md on a machine with two GPUs: W1 (Qwen-7B on GPU 0, V2-Lite on GPU 1, side by
# side), W2 (7B, V2-Lite side by side), gpu_check (graphs, TP=2), W1 Qwen-7B at TP=2. Results land in $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
O=/tmp/o; mkdir -p $O
R() { local d=$1 t=$2; shift 2; CUDA_VISIBLE_DEVICES=$d OUT=$O timeout $t bash bench/h200_run.sh "$@" >> $O/all.log 2>&1; }
save() { cp $O/*.json $OUT/ 2>/dev/null; grep -h "Throughput\|TPOT\|TTFT\|OK\|MISM\|ERROR\|Error" $O/*.log > $OUT/summary.txt 2>/dev/null; }
R 0 110 w1:r1-distill-qwen-7b:1 & R 1 110 w1:deepseek-v2-lite:1; wait; save
R 0 60 w2:deepseek-llm-7b & R 1 60 w2:deepseek-v2-lite; wait; save
timeout 90 python3 bench/gpu_check.py --cases=cuda-graphs,cuda-tp2 > $O/gpucheck.log 2>&1; save
R 0,1 110 w1:r1-distill-qwen-7b:2; save
cat $OUT/summary.txt
