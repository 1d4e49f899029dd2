#!/usr/bin/env bash
# Wheels the H200 machine lacks (it has torch, triton, transformers, aiohttp, msgpack, prometheus-client,
# uvloop, h11, anyio; no package index): the server (fastapi, uvicorn, pydantic), the grammar engine
# (llguidance, for structured output and the gate's structured suite), the C HTTP parser, and what
# fastapi imports besides (opentelemetry-api), and typing-extensions at the version pydantic asks for (the
# image's may be older). Run here,
# in the repository root; .whl/ is ignored by git and carried to the device:
#   bash bench/device_wheels.sh
#   device: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#           (carry: [".whl"]), then e.g. MODEL=r1-distill-qwen-7b bash bench/w3_serve.sh or bash bench/gate.sh structured
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection httptools llguidance \
  opentelemetry-api typing-extensions
ls .whl && du -sh .whl
