#!/usr/bin/env bash
# W3's saturation point (BENCHMARKS.md: through HTTP >= 90 % of offline W1) for server settings side by side,
# in one device call (~1 minute a variant after one offline W1): each LABEL=VAR=VALUE[,VAR=VALUE] runs
# bench/w3_serve.sh with those variables and RATES="" (no Poisson rates), reusing the first offline W1; the
# table ends with each variant's saturation ratio and its decode-phase silences (bench/stream_silences.py).
#   MODEL=r1-distill-qwen-7b OUT=$OUT/w3ab bash bench/w3_ab.sh base= freeze=DEEPSERVE_GC_FREEZE=1 \
#       both=DEEPSERVE_GC_FREEZE=1,DEEPSERVE_CORE_SEND_THREAD=1
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/w3ab-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
FIRST=""
for spec in "$@"; do
  [[ $spec == *=* ]] || { echo "w3_ab.sh: each variant is LABEL=VAR=VALUE[,VAR=VALUE] or LABEL= (got '$spec')" >&2; exit 2; }
  label="${spec%%=*}" vars="${spec#*=}"
  env_args=()
  IFS=',' read -ra pairs <<< "$vars"
  for pair in "${pairs[@]}"; do [ -n "$pair" ] && env_args+=("$pair"); done
  echo "== $label: ${env_args[*]:-defaults}"
  # Each variant starts from the defaults of the switches it may set, whatever the caller exported.
  clean=(env -u DEEPSERVE_GC_FREEZE -u DEEPSERVE_CORE_SEND_THREAD)
  if [ -z "$FIRST" ]; then
    "${clean[@]}" "${env_args[@]}" RATES="" OUT="$OUT/$label" bash bench/w3_serve.sh
    [ -s "$OUT/$label/w1-offline.json" ] && FIRST="$OUT/$label/w1-offline.json"
  else
    "${clean[@]}" "${env_args[@]}" RATES="" OUT="$OUT/$label" W1_OFFLINE="$FIRST" bash bench/w3_serve.sh
  fi
done
python - "$OUT" "$@" <<'PY'
import json, os, subprocess, sys
out, labels = sys.argv[1], [spec.split("=", 1)[0] for spec in sys.argv[2:]]
print("| variant | settings | saturation out tok/s | of offline W1 | TPOT p50 ms | decode-phase silences |")
print("|---|---|---|---|---|---|")
for spec, label in zip(sys.argv[2:], labels):
    d = os.path.join(out, label)
    try:
        sat = json.load(open(os.path.join(d, "w1-saturation.json")))
        offline = json.load(open(os.path.join(d, "w1-offline.json")))["output_tokens_per_second"]
    except OSError:
        print(f"| {label} | {spec.split('=', 1)[1] or 'defaults'} | (no result) | | | |")
        continue
    silences = subprocess.run([sys.executable, "bench/stream_silences.py", os.path.join(d, "w1-saturation.json")],
                              capture_output=True, text=True).stdout.strip().splitlines()
    decode = silences[-1].split("decode steps only: ", 1)[-1] if silences else "?"
    print(f"| {label} | {spec.split('=', 1)[1] or 'defaults'} | {sat['output_throughput']:.0f} | "
          f"{sat['output_throughput'] / offline:.1%} | {sat['p50_tpot_ms']:.2f} | {decode} |")
PY
