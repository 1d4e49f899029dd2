"""Silences in a saturation run of `deepserve bench serve`: stretches in which no stream received anything.

With every request sent at once (--request-rate inf), a chunk's arrival time is its request's TTFT plus
the gaps before it, so merging all streams gives the server's delivery timeline. A silence of many
engine steps (~10 ms each on one H200) that every stream shares stops the whole server: the W3 runs of
bench/RESULTS.md had six of 150-311 ms, 1.46 s in all, the whole gap between HTTP and offline W1.

    python bench/stream_silences.py RESULT.json [--min-ms 150]
"""

from __future__ import annotations

import argparse
import json


def arrival_times(result: dict) -> list[float]:
    """Every chunk's arrival, in seconds from the start, over all streams, sorted."""
    times = []
    for ttft, gaps in zip(result["ttfts"], result["itls"], strict=True):
        t = ttft
        times.append(t)
        for gap in gaps:
            t += gap
            times.append(t)
    return sorted(times)


def silences(times: list[float], min_s: float) -> list[tuple[float, float]]:
    """(start, length) of each stretch of at least min_s between consecutive arrivals."""
    return [(a, b - a) for a, b in zip(times[:-1], times[1:], strict=True) if b - a >= min_s]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("--min-ms", type=float, default=150.0)
    ns = ap.parse_args()
    result = json.load(open(ns.result))
    times = arrival_times(result)
    found = silences(times, ns.min_ms / 1e3)
    print(f"{len(times)} chunks from {times[0]:.2f} to {times[-1]:.2f} s (duration {result['duration']:.2f} s); "
          f"{len(found)} silences >= {ns.min_ms:.0f} ms, {sum(s for _, s in found):.2f} s in all"
          + "".join(f"; {s * 1e3:.0f} ms at {a:.1f} s" for a, s in found))


if __name__ == "__main__":
    main()
