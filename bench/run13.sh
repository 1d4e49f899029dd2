#!/usr/bin/env bash
# Run 13 of bench/RESULTS.md: what the prefill-attention fix (commit 34b42fb: SDPA's flash kernel instead
# of its math path) changes, then the W1/W2 figures of this commit, then #7's TP=2 runs.
#   bash bench/run13.sh a    # one H200: prefill check, profiles with their prefill step, W1 Qwen and V2-Lite
#   bash bench/run13.sh b    # one H200: W1 V2-Lite step by step, W1 DeepSeek-LLM-7B, W2 x2, the HF baseline
#   bash bench/run13.sh tp   # two H200s: W1 at TP=2 with decode graphs and async (Qwen, V2-Lite, V2-Lite EP)
# Each mode is one device call (the limits below add up to under 10 minutes).
# Everything lands in $OUT as summary.txt plus run13-<mode>.tgz of the logs and JSON files; a step cut by its
# limit loses only itself (its leftovers are killed, as in run12.sh).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
mode=$1
O=/tmp/run13-$mode; mkdir -p $O
H() {
  local gpus=$1 limit=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT=$O timeout -k 10 "$limit" bash bench/h200_run.sh "$@" >> $O/steps.log 2>&1
  pkill -9 -f "deepserve.entrypoints.cli"; pkill -9 -f "multiprocessing.spawn"; pkill -9 -f profile_step; sleep 2
}
save() {
  grep -h "Throughput\|TPOT\|SUMMARY\| OK \|MISMATCH\|ERROR\|prefill\|fused_sdpa\|old 3-D\|varlen\|rc=" \
    $O/*.log > $OUT/summary.txt 2>/dev/null
  tar -czf $OUT/run13-$mode.tgz -C $O . 2>/dev/null
}
(while sleep 20; do save; done) & saver=$!
if [ "$mode" = tp ]; then
  # Decode graphs on the TP ranks: DEEPSERVE_TP_CUDA_GRAPHS=1 when this ran; --no-enforce-eager since.
  GRAPHS=--no-enforce-eager
  PYTHONPATH=$PWD timeout 150 python3 bench/gpu_check.py --cases=cuda-tp2,cuda-tp2-ep > $O/gpucheck-tp2.log 2>&1; save
  EXTRA="--async-scheduling $GRAPHS" TAG=-graphs-async H 0,1 120 w1:r1-distill-qwen-7b:2; save
  EXTRA="--async-scheduling $GRAPHS" TAG=-graphs-async H 0,1 140 w1:deepseek-v2-lite:2; save
  EXTRA="--async-scheduling $GRAPHS" TAG=-graphs-async H 0,1 140 w1:deepseek-v2-lite:2:ep; save
elif [ "$mode" = a ]; then
  H 0 60 prefill; save
  H 0 100 profile:r1-distill-qwen-7b:256:600:0.6; save
  H 0 110 profile:deepseek-v2-lite:256:600:0.6; save
  H 0 80 w1:r1-distill-qwen-7b:1; save
  H 0 100 w1:deepseek-v2-lite:1; save
else
  EXTRA=--no-async-scheduling TAG=-sync H 0 100 w1:deepseek-v2-lite:1; save
  H 0 100 w1:deepseek-llm-7b:1; save
  H 0 60 w2:deepseek-llm-7b; save
  H 0 60 w2:deepseek-v2-lite; save
  H 0 120 hf-llm; save
fi
kill $saver 2>/dev/null
save
cat $OUT/summary.txt
