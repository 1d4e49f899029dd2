#!/usr/bin/env bash
# Exports commits for a same-machine A/B (bench/ab.py) into .ab/<commit>/, ignored by git and carried to
# the device machine (its copy of .git may be stale, so the trees travel as files):
#   bash bench/ab_trees.sh ad0a903 HEAD      # then, on the device: bash bench/gate.sh ab   (carry: .ab)
# The first commit named is the base; the others are compared with it. Each tree holds deepserve/, bench/
# and pyproject.toml (~2.5 MB).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -ge 2 ] || { echo "usage: bash bench/ab_trees.sh BASE NEW [NEW...]" >&2; exit 2; }
mkdir -p .git/info
grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
rm -rf .ab && mkdir .ab
i=0
for ref in "$@"; do
  sha=$(git rev-parse --short "$ref")
  dir=".ab/$i-$sha"  # the order prefix keeps the base first
  mkdir -p "$dir" && git archive "$sha" deepserve bench pyproject.toml | tar -x -C "$dir"
  echo "$dir ($ref)"
  i=$((i + 1))
done
