#!/usr/bin/env bash
# One device call: correctness first, then the timed workloads. Each step logs to $OUT and a
# failure in one step does not stop the next. Usage: bash bench/h200_run.sh [steps...]
# steps: env kernels prefill moe moesweep gpucheck gpucheck1 (one GPU only) gputests w1-qwen w1-llm w2-llm hf-llm w1-v2lite w2-v2lite (default: all but w1-v2lite)
#        profile:MODEL:BATCH:PROMPT_LEN:TEMPERATURE (bench/profile_step.py)
#        w1:MODEL:TP[:ep]  w2:MODEL  (W1 / W2 on any preset, TP ranks, ep = --enable-expert-parallel)
#        w1v3slice:TP[:ep]  (W1 on the first 8 layers of DeepSeek-V3, bf16 dummy weights)
# TAG=-x appends -x to the w1:/w2: step names (to run the same step under another environment);
# EXTRA="--flag ..." adds engine flags to the w1:/w2: steps (e.g. EXTRA=--no-async-scheduling TAG=-sync).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
DS="python3 -m deepserve.entrypoints.cli"
steps=${*:-env kernels gpucheck w1-qwen w1-llm w2-llm hf-llm}
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout 900 "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  summary+=("$name rc=$rc $((SECONDS - t0))s: $(grep -E 'Throughput|TTFT|HF transformers|OK|MISMATCH|ERROR|PASS|FAIL|SUMMARY' "$OUT/$name.log" | tail -n 3 | tr '\n' ' ')")
}
for s in $steps; do
  case $s in
    env) run env bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; git log --oneline -1 2>/dev/null || true" ;;
    kernels) run kernels python3 bench/check_kernels.py --no-variants ;;
    prefill) run prefill python3 bench/check_prefill.py ;;
    moe) run moe python3 bench/check_fused_moe.py ;;
    gpucheck) run gpucheck python3 bench/gpu_check.py ;;
    gpucheck1) run gpucheck1 python3 bench/gpu_check.py --no-parallel ;;
    moesweep) run moesweep python3 bench/sweep_moe_config.py --out "$OUT" ;;
    w1-qwen) run w1-qwen $DS bench throughput --model r1-distill-qwen-7b --load-format dummy --max-model-len 4096 --output-json "$OUT/w1-qwen.json" ;;
    w1-llm) run w1-llm $DS bench throughput --model deepseek-llm-7b --load-format dummy --max-model-len 4096 --output-json "$OUT/w1-llm.json" ;;
    w2-llm) run w2-llm $DS bench latency --model deepseek-llm-7b --load-format dummy --max-model-len 4096 --output-json "$OUT/w2-llm.json" ;;
    hf-llm) run hf-llm $DS bench throughput --model deepseek-llm-7b --load-format dummy --max-model-len 4096 --num-seqs 64 --max-output-len 256 --baseline hf --output-json "$OUT/hf-llm.json" ;;
    w2-v2lite) run w2-v2lite $DS bench latency --model deepseek-v2-lite --load-format dummy --max-model-len 4096 --output-json "$OUT/w2-v2lite.json" ;;
    gputests) run gputests python3 -m pytest -q -x tests/kernels tests/layers/test_sampler.py tests/layers/test_mla.py ;;
    w1:*) IFS=: read -r _ model tp ep <<< "$s"; name="w1-$model-tp$tp${ep:+-ep}${TAG:-}"
      run "$name" $DS bench throughput --model "$model" --load-format dummy --max-model-len 4096 -tp "$tp" \
        ${ep:+--enable-expert-parallel} ${EXTRA:-} --output-json "$OUT/$name.json" ;;
    w2:*) model=${s#w2:}
      run "w2-$model${TAG:-}" $DS bench latency --model "$model" --load-format dummy --max-model-len 4096 \
        ${EXTRA:-} --output-json "$OUT/w2-$model${TAG:-}.json" ;;
    w1v3slice:*) IFS=: read -r _ tp ep <<< "$s"; name="w1-v3slice8-tp$tp${ep:+-ep}"
      run "$name" $DS bench throughput --model deepseek-v3 --load-format dummy --max-model-len 4096 -tp "$tp" \
        ${ep:+--enable-expert-parallel} --hf-overrides '{"num_hidden_layers": 8}' --output-json "$OUT/$name.json" ;;
    profile:*) IFS=: read -r _ model batch plen temp <<< "$s"
      run "profile-$model-b$batch" python3 bench/profile_step.py --model "$model" --batch "$batch" \
        --prompt-len "$plen" --temperature "$temp" --out "$OUT" ;;
    w1-v2lite) run w1-v2lite $DS bench throughput --model deepseek-v2-lite --load-format dummy --max-model-len 4096 --output-json "$OUT/w1-v2lite.json" ;;
  esac
done
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
