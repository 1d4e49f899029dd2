#!/usr/bin/env bash
# A structured-output switch's A/B, one device call: the switch's correctness check, then `gate.py model
# r1-distill-qwen-7b-json` (W1 with a JSON schema on every request and the same lengths unconstrained, one
# engine) with the switch 0,1,1,0 (order alternated so drift cancels), each run started only while the
# call's budget holds one more; the ratios last. Carry .whl (llguidance).
#   device run: bash bench/structured_ab.sh                                          # DEEPSERVE_GRAMMAR_OVERLAP
#   device run: SWITCH=DEEPSERVE_PINNED_GRAMMAR_MASKS bash bench/structured_ab.sh    # ($OUT: JSONs, logs)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/deepserve-pycache
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/structured-ab}; mkdir -p "$OUT"; START=$SECONDS; BUDGET=${BUDGET:-560}; RUN_S=${RUN_S:-120}
SWITCH=${SWITCH:-DEEPSERVE_GRAMMAR_OVERLAP}
# DEEPSERVE_GC_FREEZE_GENERATE=1 in the caller's environment runs both arms with the offline heap frozen while
# generate runs (a 259-339 ms full collection landing in one arm and not the other is ~3 % of a run; bench/
# RESULTS.md, seventh session of 2026-12-02); it is not the engine's default, so the output says which it was.
echo "DEEPSERVE_GC_FREEZE_GENERATE=${DEEPSERVE_GC_FREEZE_GENERATE:-0} in both arms"
if [ "$SWITCH" = DEEPSERVE_GRAMMAR_OVERLAP ]; then
  python3 bench/check_grammar_overlap.py >"$OUT/switch-check.log" 2>&1
else  # the pinned slots' CUDA test: copies behind a busy stream arrive as filled
  python3 -m pytest -q -p no:cacheprovider tests/layers/test_sampler.py -k mask >"$OUT/switch-check.log" 2>&1
fi
echo "$SWITCH check rc $? ($((SECONDS-START)) s)"; tail -3 "$OUT/switch-check.log"
i=0
for v in ${ORDER:-0 1 1 0}; do
  i=$((i+1))
  if [ $((SECONDS-START+RUN_S)) -gt "$BUDGET" ]; then echo "skipped run $i ($SWITCH=$v): budget"; continue; fi
  env "$SWITCH=$v" python3 bench/gate.py model r1-distill-qwen-7b-json --json "$OUT/json-$i-sw$v.json" \
    >"$OUT/json-$i-sw$v.log" 2>&1
  echo "run $i $SWITCH=$v rc $? ($((SECONDS-START)) s)"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':16} {'W1 json':>9} {'same len':>9} {'ratio':>7} {'json 2nd':>9} {'ratio':>7}")
for p in sorted(pathlib.Path(sys.argv[1]).glob("json-*.json")):
    d = json.loads(p.read_text()); r = d.get("result", d)
    a, b, c = r.get("w1"), r.get("w1_same_lengths"), r.get("w1_2nd")
    print(f"{p.stem:16} {a or 0:>9.0f} {b or 0:>9.0f} {(a / b if a and b else 0):>7.3f} {c or 0:>9.0f}"
          f" {(c / b if c and b else 0):>7.3f}")
PY
