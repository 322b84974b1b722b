"""GET /metrics of serve.py: the engine's counters (engine.stats(), sent by the engine process
with every step) in Prometheus' text exposition format, with two rates computed here."""

from __future__ import annotations

import math
from typing import Any

# engine.stats() key -> (metric, type, help)
METRICS = {
    "running": ("tiny_llm_requests_running", "gauge", "requests holding a decode slot"),
    "waiting": ("tiny_llm_requests_waiting", "gauge", "requests waiting for a slot or pages"),
    "pages_in_use": ("tiny_llm_kv_pages_in_use", "gauge", "KV pages held by requests"),
    "pages_free": (
        "tiny_llm_kv_pages_free",
        "gauge",
        "KV pages free in a bounded pool (cached pages included: an allocation may take them)",
    ),
    "pages_cached": (
        "tiny_llm_kv_pages_cached",
        "gauge",
        "KV pages no request holds, kept for the prefix cache (reclaimable, counted as free)",
    ),
    "prompt_tokens_prefilled": (
        "tiny_llm_prompt_tokens_prefilled_total",
        "counter",
        "prompt tokens run through the model",
    ),
    "prompt_tokens_cached": (
        "tiny_llm_prompt_tokens_cached_total",
        "counter",
        "prompt tokens found in the prefix cache at admissions, not run through the model",
    ),
    "prefix_hit_rate": (  # computed here from the two counters above
        "tiny_llm_prefix_cache_hit_rate",
        "gauge",
        "prompt tokens cached / (cached + prefilled), since the start; 0 before any",
    ),
    "tokens_decoded": ("tiny_llm_tokens_decoded_total", "counter", "tokens generated"),
    "tokens_proposed": (
        "tiny_llm_spec_tokens_proposed_total",
        "counter",
        "tokens guessed by speculative decoding's proposer and checked by the model",
    ),
    "tokens_accepted": (
        "tiny_llm_spec_tokens_accepted_total",
        "counter",
        "guessed tokens the model kept (each saves a pass over the weights)",
    ),
    "spec_acceptance_rate": (  # computed here from the two counters above
        "tiny_llm_spec_acceptance_rate",
        "gauge",
        "guessed tokens accepted / proposed, since the start; 0 before any",
    ),
    "preemptions": ("tiny_llm_preemptions_total", "counter", "requests preempted for pages"),
    "requests_finished": ("tiny_llm_requests_finished_total", "counter", "requests finished"),
    "requests_aborted": ("tiny_llm_requests_aborted_total", "counter", "requests aborted"),
    "engine_failures": (
        "tiny_llm_engine_failures_total",
        "counter",
        "engine steps that raised (their requests failed with a 500; serving went on)",
    ),
    "refused_busy": (  # the server's own count, not the engine's
        "tiny_llm_requests_refused_busy_total",
        "counter",
        "requests refused with 429 (--max-waiting)",
    ),
}


def prefix_hit_rate(stats: dict[str, Any]) -> float:
    """The share of the prompt tokens admitted so far whose KV the prefix cache held: cached /
    (cached + prefilled), 0 before any prompt token (and with an engine that counts none)."""
    cached = stats.get("prompt_tokens_cached", 0)
    total = cached + stats.get("prompt_tokens_prefilled", 0)
    return cached / total if total else 0.0


def acceptance_rate(stats: dict[str, Any]) -> float:
    """The share of speculative decoding's guesses that the model kept: accepted / proposed,
    0 before any guess (and without speculation, or with an engine that counts none)."""
    proposed = stats.get("tokens_proposed", 0)
    return stats.get("tokens_accepted", 0) / proposed if proposed else 0.0


def prometheus_text(stats: dict[str, Any], refused_busy: int) -> str:
    """Prometheus' text exposition format: # HELP, # TYPE, then `name value`. A stat that is
    None (pages_free of an unbounded pool) is left out; a stat not in METRICS is a gauge."""
    lines = []
    extra = {
        "prefix_hit_rate": round(prefix_hit_rate(stats), 6),
        "spec_acceptance_rate": round(acceptance_rate(stats), 6),
        "refused_busy": refused_busy,
    }
    for key, value in {**stats, **extra}.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
            continue
        name, kind, help_text = METRICS.get(key, (f"tiny_llm_{key}", "gauge", f"engine {key}"))
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
