#!/usr/bin/env bash
# A switch's A/B through bench/step_trace.py, one device call: W1 (with the gate's JSON schema unless
# SCHEMA=0) traced with the switch 0,1,0,1 (alternated so drift cancels), the heap frozen as the server does
# (--gc-freeze: no full collection lands in one arm only), each run started only while the budget holds one
# more; every run's W1 and its per-kind table last. ~40 s a run on one H200 (R1-Distill-Qwen-7B).
#   device run (carry .whl for the schema):
#     SWITCH=DEEPSERVE_PINNED_GRAMMAR_MASKS bash bench/trace_ab.sh
#     SWITCH=DEEPSERVE_GRAMMAR_OVERLAP MODEL=r1-distill-qwen-7b bash bench/trace_ab.sh
export PYTHONUNBUFFERED=1
[ -n "$SWITCH" ] || { echo "usage: SWITCH=ENV_VAR [MODEL=preset] [SCHEMA=0] bash bench/trace_ab.sh" >&2; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/trace-ab}; mkdir -p "$OUT"; START=$SECONDS; BUDGET=${BUDGET:-540}; RUN_S=${RUN_S:-70}
MODEL=${MODEL:-r1-distill-qwen-7b}; FLAGS="--gc-freeze"; [ "${SCHEMA:-1}" = 1 ] && FLAGS="$FLAGS --json-schema"
i=0
for v in ${ORDER:-0 1 0 1}; do
  i=$((i+1))
  if [ $((SECONDS-START+RUN_S)) -gt "$BUDGET" ]; then echo "skipped run $i ($SWITCH=$v): budget"; continue; fi
  env "$SWITCH=$v" timeout "$RUN_S" python3 bench/step_trace.py "$MODEL" $FLAGS --out "$OUT/trace-$i-sw$v.json" \
    >"$OUT/trace-$i-sw$v.log" 2>&1
  echo "run $i $SWITCH=$v rc $? ($((SECONDS-START)) s)"
done
gzip -f "$OUT"/*.json 2>/dev/null
for f in "$OUT"/trace-*.log; do
  echo "== $(basename "$f")"; grep -E "out tok/s|^(kind|all|graph|eager)|^gc" "$f" | cut -c1-240
done
