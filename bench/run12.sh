#!/usr/bin/env bash
# Run 12 of bench/RESULTS.md on a machine with two H200s, in two device calls:
#   bash bench/run12.sh tp      # TP graphs teardown probe, TP=2 greedy checks, W1 at TP=2 (Qwen, V2-Lite, V2-Lite EP)
#   bash bench/run12.sh single  # W1/W2 with and without async scheduling, profiles, HF baseline; two lanes, one per GPU
# Everything lands in $OUT as summary.txt plus one run12-<mode>.tgz of the logs and JSON files.
# What ran in run 12: `tp` as written (before the leftover-process kill below was added), and a shortened
# `single` (the device time left): lane 0 without W1 DeepSeek-LLM-7B, lane 1 without the V2-Lite profile and
# the HF baseline (bench/RESULTS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
mode=$1
O=/tmp/run12-$mode; mkdir -p $O
# A step cut by its time limit must not leave its engine behind: in run 12 a killed TP=2 run's process
# kept 127 GiB of GPU 0 and the next run failed out of memory. Hence the kill of the command's leftovers.
H() {
  local gpus=$1 limit=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT=$O timeout -k 10 "$limit" bash bench/h200_run.sh "$@" >> $O/lanes.log 2>&1
  [ "$gpus" = 0,1 ] && { pkill -9 -f "deepserve.entrypoints.cli" ; pkill -9 -f "multiprocessing.spawn"; sleep 3; }
}
save() {
  grep -h "Throughput\|TPOT\|SUMMARY\| OK \|MISMATCH\|ERROR\|destroyed\|max error\|rc=" $O/*.log > $OUT/summary.txt 2>/dev/null
  tar -czf $OUT/run12-$mode.tgz -C $O . 2>/dev/null
}
(while sleep 20; do save; done) & saver=$!  # what finished comes back even if the call is cut short
if [ "$mode" = tp ]; then
  env PYTHONPATH=$PWD timeout 60 python3 bench/tp_graph_probe.py raw global reset > $O/probe-reset.log 2>&1; save
  PYTHONPATH=$PWD timeout 200 python3 bench/gpu_check.py --cases=cuda-tp2,cuda-tp2-ep > $O/gpucheck-tp2.log 2>&1; save
  # Should the graphs under TP fail their check, the throughput runs fall back to eager TP ranks.
  if grep -q "MISMATCH\|ERROR" $O/gpucheck-tp2.log || ! grep -q "dsv3-noaux cuda-tp2-ep" $O/gpucheck-tp2.log; then
    echo "TP graphs off for W1 (DEEPSERVE_TP_CUDA_GRAPHS=0 when this ran; eager TP ranks are the default since)" >> $O/gpucheck-tp2.log
  fi
  H 0,1 110 w1:r1-distill-qwen-7b:2; save
  H 0,1 130 w1:deepseek-v2-lite:2; save
  H 0,1 130 w1:deepseek-v2-lite:2:ep; save
else
  lane0() {
    H 0 90 w1:r1-distill-qwen-7b:1
    EXTRA=--no-async-scheduling TAG=-sync H 0 90 w1:r1-distill-qwen-7b:1
    H 0 110 w1:deepseek-llm-7b:1
    H 0 80 w2:deepseek-llm-7b
    H 0 100 profile:r1-distill-qwen-7b:256:600:0.6
  }
  lane1() {
    H 1 120 w1:deepseek-v2-lite:1
    EXTRA=--no-async-scheduling TAG=-sync H 1 120 w1:deepseek-v2-lite:1
    H 1 80 w2:deepseek-v2-lite
    H 1 110 profile:deepseek-v2-lite:256:600:0.6
    H 1 120 hf-llm
  }
  lane0 & p0=$!; lane1; wait $p0
fi
kill $saver 2>/dev/null
save
cat $OUT/summary.txt
