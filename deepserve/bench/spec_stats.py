"""Speculative decoding's figures for a benchmark run: what the engine's counters moved by during it."""

from __future__ import annotations

from typing import Any

from deepserve.engine.scheduler import SchedulerStats


def spec_decode_summary(engine, before: SchedulerStats) -> dict[str, Any] | None:
    """None without speculative decoding; else the method, k, and over the run the verify steps (drafts),
    draft tokens, accepted tokens, acceptance rate and mean accepted length (tokens per verify step, the
    target's own included: vLLM's two summaries)."""
    spec = engine.core.config.speculative
    if spec is None:
        return None
    after = engine.stats()
    drafts = after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    draft_tokens = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
    }


def describe(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return ""
    return (f"; speculative {summary['method']} k={summary['num_speculative_tokens']}: acceptance rate "
            f"{summary['acceptance_rate']:.3f}, mean accepted length {summary['mean_accepted_length']:.2f}")
