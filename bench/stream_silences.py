"""Silences in a saturation run of `deepserve bench serve`: stretches in which no stream received anything.

With every request sent at once (--request-rate inf), a chunk's arrival time is its request's TTFT plus
the gaps before it, so merging all streams gives the server's delivery timeline. While prompts are still
being prefilled a step can take 100-160 ms on one H200 (8,192-token chunks), so a silence there is partly
ordinary work; after the last first token every step is a decode step of ~10 ms, and a silence of
hundreds of ms stopped the whole server. The W3 runs of bench/RESULTS.md had three such decode-phase
silences of 168-282 ms each.

    python bench/stream_silences.py RESULT.json[.gz] [--min-ms 150]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys


def arrival_times(result: dict) -> tuple[list[float], float]:
    """Every chunk's arrival, in seconds from the start, over the streams that succeeded, sorted; and the
    last first token's time (where the decode phase begins)."""
    times, first = [], []
    errors = result.get("errors") or [""] * len(result["ttfts"])
    for ttft, gaps, error in zip(result["ttfts"], result["itls"], errors, strict=True):
        if error:  # a failed request has no chunks (its ttft is 0)
            continue
        t = ttft
        first.append(t)
        times.append(t)
        for gap in gaps:
            t += gap
            times.append(t)
    return sorted(times), max(first, default=0.0)


def silences(times: list[float], min_s: float) -> list[tuple[float, float]]:
    """(start, length) of each stretch of at least min_s between consecutive arrivals."""
    return [(a, b - a) for a, b in zip(times[:-1], times[1:], strict=True) if b - a >= min_s]


def describe(found: list[tuple[float, float]]) -> str:
    total = sum(length for _, length in found)
    return f"{len(found)}, {total:.2f} s" + "".join(f"; {s * 1e3:.0f} ms at {a:.1f} s" for a, s in found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("--min-ms", type=float, default=150.0)
    ns = ap.parse_args()
    with (gzip.open if ns.result.endswith(".gz") else open)(ns.result, "rt") as f:
        result = json.load(f)
    if "itls" not in result or "ttfts" not in result:
        sys.exit(f"{ns.result} has no per-request ttfts / itls (a summary without the lists?)")
    times, decode_from = arrival_times(result)
    if not times:
        sys.exit(f"{ns.result}: no request succeeded")
    found = silences(times, ns.min_ms / 1e3)
    decode = [(a, s) for a, s in found if a >= decode_from]
    print(f"{len(times)} chunks from {times[0]:.2f} to {times[-1]:.2f} s (duration {result['duration']:.2f} s); "
          f"silences >= {ns.min_ms:.0f} ms: {describe(found)}")
    print(f"after the last first token ({decode_from:.2f} s), decode steps only: {describe(decode)}")


if __name__ == "__main__":
    main()
