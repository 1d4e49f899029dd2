#!/usr/bin/env bash
# W3 (BENCHMARKS.md) on one GPU, no downloads: the offline W1 figure, then `deepserve serve PRESET
# --load-format dummy` driven by `deepserve bench serve` at three Poisson rates (~200 in / 180 out,
# 30 s of arrivals each) and at saturation (W1's 256 requests at once through HTTP). Prints a table;
# exits 1 if any request failed or the saturation throughput is under 90 % of the offline W1.
#   MODEL=r1-distill-qwen-7b bash bench/w3_serve.sh        (about 3.5 minutes on one H200)
# RATES="" runs the saturation point alone and W1_OFFLINE=FILE reuses an offline W1: bench/w3_ab.sh's A/B.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-r1-distill-qwen-7b}"
PORT="${PORT:-8011}"
OUT="${OUT:-bench/results/w3-$(date -u +%Y%m%d-%H%M%S)}"
KEY="sk-w3-$(python -c 'import secrets; print(secrets.token_hex(12))')"
mkdir -p "$OUT"

if [ -n "${W1_OFFLINE:-}" ]; then  # an A/B of server settings in one call reuses the first run's offline W1
  [ "$W1_OFFLINE" -ef "$OUT/w1-offline.json" ] || cp "$W1_OFFLINE" "$OUT/w1-offline.json"
else
  deepserve bench throughput --model "$MODEL" --load-format dummy --output-json "$OUT/w1-offline.json" \
    > "$OUT/w1-offline.log" 2>&1
fi

deepserve serve "$MODEL" --load-format dummy --api-key "$KEY" --host 127.0.0.1 --port "$PORT" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -fsS "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "server died; see $OUT/server.log" >&2; exit 1; }
  sleep 1
done

bench() { deepserve bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --api-key "$KEY" \
            --metric-percentiles 50,99 "$@" > /dev/null; }
for RATE in ${RATES-4 8 16}; do  # RATES="" runs the saturation point alone (an A/B: bench/w3_ab.sh)
  bench --dataset random --random-input-len 200 --random-output-len 180 --random-range-ratio 0.1 \
        --request-rate "$RATE" --num-prompts $((RATE * 30)) --output-json "$OUT/rate-$RATE.json"
done
bench --dataset w1 --num-prompts 256 --request-rate inf --output-json "$OUT/w1-saturation.json"

python bench/stream_silences.py "$OUT/w1-saturation.json" || true  # where the saturation run stalled
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
load = lambda name: json.load(open(os.path.join(out, name)))
print(f"| run | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed |")
print("|---|---|---|---|---|---|")
failed = 0
for name in ["rate-4.json", "rate-8.json", "rate-16.json", "w1-saturation.json"]:
    if not os.path.exists(os.path.join(out, name)):
        continue  # a rate RATES left out
    r = load(name)
    failed += r["failed"]
    print(f"| {name[:-5]} | {r['request_throughput']:.2f} | {r['output_throughput']:.0f} | "
          f"{r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['p50_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f} | "
          f"{r['failed']} |")
offline = load("w1-offline.json")["output_tokens_per_second"]
ratio = load("w1-saturation.json")["output_throughput"] / offline
print(f"saturation through HTTP: {ratio:.1%} of offline W1 ({offline:.0f} output tok/s); target >= 90 %")
sys.exit(1 if failed or ratio < 0.9 else 0)
PY
