#!/usr/bin/env bash
# Where a one-token decode step goes, for several variants in one device call: bench/profile_step.py per
# variant (batch 1, 1,024-token prompt, dummy weights, no prefill timing), then for each its graph replay and
# wall ms and the graph's largest kernels (µs a step, calls a step). A variant is "model[:quantization][:ENV=v,...]";
# EXTRA="--layers 8" profiles the gate's V3 slice, EXTRA="--kv-cache-dtype fp8" an FP8 cache.
#   device run:  bash bench/decode_profile.sh deepseek-llm-7b deepseek-llm-7b:fp8 deepseek-llm-7b:awq \
#                  deepseek-llm-7b:awq:DEEPSERVE_INT4_GEMV_FACTORED=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/decode-profile}; mkdir -p "$OUT"; START=$SECONDS; BUDGET=${BUDGET:-540}; RUN_S=${RUN_S:-120}
[ $# -gt 0 ] || { echo "usage: bash bench/decode_profile.sh model[:quant][:ENV=v,...] ..." >&2; exit 2; }
i=0
for variant in "$@"; do
  i=$((i+1)); IFS=: read -r model quant envs <<<"$variant"
  if [ $((SECONDS-START+RUN_S)) -gt "$BUDGET" ]; then echo "skipped $variant: budget"; continue; fi
  args=(--model "$model" --batch "${BATCH:-1}" --prefill-tokens 0 --steps "${STEPS:-30}" --tag "v$i" --out "$OUT")
  [ -n "$quant" ] && args+=(--quantization "$quant")
  args+=(${EXTRA:-})  # e.g. EXTRA="--prompt-len 4096 --max-model-len 8192"
  env ${envs//,/ } timeout "$RUN_S" python3 bench/profile_step.py "${args[@]}" >"$OUT/v$i.log" 2>&1
  echo "v$i $variant rc $? ($((SECONDS-START)) s)"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/*-profile.json")):
    r = json.load(open(path))
    print(f"== {path.rsplit('/', 1)[-1]}: graph replay {r['graph_replay_ms']} ms, wall {r['wall_ms_per_step']} ms, "
          f"async {r['async_wall_ms_per_step']} ms")
    for name, us, calls in r["graph_top_kernels_us"][:10]:
        print(f"  {us:8.1f} us {calls:4d}x  {name[:90]}")
PY
