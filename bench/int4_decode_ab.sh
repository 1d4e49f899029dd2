#!/usr/bin/env bash
# The int4 decode GEMVs at one token, one device call: the variants at M = 1 (and the expert GEMVs at
# T = 1, 2) checked and timed (bench/check_int4.py), the engine with them on the GPU against the CPU
# reference, then W2 (deepserve bench latency, dummy AWQ weights) with the GEMVs off (the defaults) and
# on: DEEPSERVE_INT4_GEMV_MAX_M=1 for the linear layers, DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS=1 for the
# experts. TPOT table last.
#   device run: bash bench/int4_decode_ab.sh          ($OUT gets the JSONs and logs)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/deepserve-pycache
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/int4-decode}; mkdir -p "$OUT"; START=$SECONDS
timeout 240 python3 bench/check_int4.py --variants --ms 1 --moe-tokens 1,2 --json "$OUT/variants.json" \
  >"$OUT/variants.log" 2>&1; echo "variants rc $? ($((SECONDS-START)) s)"
sed -n '/best per/,$p' "$OUT/variants.log" | head -30
grep -E "^ +(7B|Lite|V2-Lite)" "$OUT/variants.log" | grep -E "M=1 |T=1 " | cut -c1-400
DEEPSERVE_INT4_GEMV_MAX_M=1 DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS=1 timeout 150 python3 bench/check_int4_engine.py \
  >"$OUT/engine-gemv-on.log" 2>&1; echo "engine check with the GEMVs rc $? ($((SECONDS-START)) s)"; tail -4 "$OUT/engine-gemv-on.log"
run() {  # label model env...
  local label=$1 model=$2; shift 2
  env "$@" timeout 120 deepserve bench latency --model "$model" --load-format dummy --quantization awq \
    --max-model-len 4096 --input-len 1024 --output-len 256 --iters 5 --output-json "$OUT/w2-$label.json" \
    >"$OUT/w2-$label.log" 2>&1
  echo "w2 $label rc $? ($((SECONDS-START)) s)"
}
run 7b-off deepseek-llm-7b DEEPSERVE_INT4_GEMV_MAX_M=0
run 7b-on deepseek-llm-7b DEEPSERVE_INT4_GEMV_MAX_M=1
run lite-off deepseek-v2-lite DEEPSERVE_INT4_GEMV_MAX_M=0 DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS=0
run lite-on deepseek-v2-lite DEEPSERVE_INT4_GEMV_MAX_M=1 DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS=1
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'W2 (-q awq, dummy)':20} {'TPOT ms':>8} {'TTFT ms':>8}")
for label in ("7b-off", "7b-on", "lite-off", "lite-on"):
    p = pathlib.Path(sys.argv[1]) / f"w2-{label}.json"
    if p.exists():
        d = json.loads(p.read_text())
        print(f"{label:20} {d.get('tpot_ms_median', 0):>8.2f} {d.get('ttft_ms_median', 0):>8.1f}")
    else:
        print(f"{label:20} {'(no result)':>17}")
PY
