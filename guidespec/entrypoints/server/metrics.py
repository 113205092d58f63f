"""The server's Prometheus series (``/metrics``): latencies, tokens, finished and failed
requests, grammar refusals and failures, read from each finished ``GenerationOutput``; the
scheduler's queue depths and the engine's restarts, read from the ``LLM`` when scraped.

What each series counts is decided here; when to count (which answer failed, with which
status) is the routes' business.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from guidespec.grammar_backends.interface import refusals_in
from guidespec.llm import EngineClient, GenerationOutput, RequestError
from guidespec.protocol import GRAMMAR_FAILED


class ServerMetrics:
    """The series, in a registry of their own (one per app)."""

    def __init__(self, llm: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_RestartCollector(llm))
        r.register(_CacheCollector(llm))
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram(
            "guidespec_time_to_first_token_seconds", "Time to first token", registry=r, buckets=latency_buckets
        )
        self.itl = Histogram(
            "guidespec_inter_token_latency_seconds",
            "Time per output token after the first",
            registry=r,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        )
        self.e2e = Histogram(
            "guidespec_e2e_request_latency_seconds", "End-to-end request latency", registry=r, buckets=latency_buckets
        )
        self.accepted = Histogram(
            "guidespec_accepted_tokens_per_step",
            "Tokens per step of speculating requests (the target's own token included)",
            registry=r,
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
        )
        self.finished = Counter(
            "guidespec_request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.failed = Counter(
            "guidespec_request_failure", "Requests refused or failed, by HTTP status", ["status"], registry=r
        )
        self.refusals = Counter(
            "guidespec_grammar_refusals",
            "Grammars a backend refused (it cannot enforce them "
            "exactly), by backend and the keyword it named; with backend auto the other one "
            "may have served the request",
            ["backend", "keyword"],
            registry=r,
        )
        self.grammar_failures = Counter(
            "guidespec_grammar_failures",
            "Grammars that stopped before their output was complete (a backend's limit met "
            "mid-way), by backend and outcome: the request failed (grammar_failed) or started "
            "again on the next backend of auto (restarted)",
            ["backend", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("guidespec_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("guidespec_generation_tokens", "Generated tokens", registry=r)
        self.in_server = Gauge("guidespec_num_requests_in_server", "HTTP requests being served", registry=r)
        for field, doc in (
            ("running", "Requests holding a KV slot"),
            ("waiting", "Requests queued for a slot (queue depth)"),
            ("waiting_for_grammar", "Requests waiting for their grammar to compile"),
        ):
            gauge = Gauge(f"guidespec_num_requests_{field}", doc, registry=r)
            gauge.set_function(_stat_reader(llm, field))
        usage = Gauge(
            "guidespec_kv_cache_usage_perc", "Share of the KV cache's blocks running requests hold", registry=r
        )
        usage.set_function(lambda: _kv_usage(llm))

    def count_refusals(self, message: str) -> None:
        for backend, keyword in refusals_in(message):
            self.refusals.labels(backend=backend, keyword=keyword).inc()

    def count_grammar_failure(self, e: Exception) -> None:
        """A request that failed with ``grammar_failed``, by the backend its message names."""
        if isinstance(e, RequestError) and e.code == GRAMMAR_FAILED:
            for backend in _GAVE_UP.findall(str(e))[-1:]:
                self.grammar_failures.labels(backend=backend, outcome="failed").inc()

    def observe(self, out: GenerationOutput) -> None:
        self.count_refusals(out.grammar_refusal)
        for backend in _GAVE_UP.findall(out.grammar_refusal)[: out.stats.grammar_restarts]:
            self.grammar_failures.labels(backend=backend, outcome="restarted").inc()
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        if out.first_token_time:
            self.ttft.observe(out.time_to_first_token_s)
            if len(out.token_ids) > 1:
                self.itl.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))
        self.e2e.observe(out.latency_s)
        if out.stats.num_spec_steps:
            self.accepted.observe(out.stats.mean_accepted_tokens_per_step)


_GAVE_UP = re.compile(r"\b(xgrammar|llguidance) gave up:")  # a grammar failure's backend (GrammarManager.error)


def _kv_usage(llm: EngineClient) -> float:
    stats = llm.scheduler_stats
    return stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0


def _stat_reader(llm: EngineClient, field: str) -> Any:
    return lambda: float(getattr(llm.scheduler_stats, field))


class _RestartCollector:
    """``guidespec_engine_restarts_total``: fresh engines started after a death (counted by the LLM)."""

    def __init__(self, llm: EngineClient) -> None:
        self.llm = llm

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "guidespec_engine_restarts", "Engine restarts after a process died", value=self.llm.num_restarts
        )


class _CacheCollector:
    """The KV cache's and the grammars' counters since the engine started (the scheduler's
    figures): prompt tokens looked up in the prefix cache and those found there, preemptions,
    grammars compiled and grammars another engine had compiled."""

    def __init__(self, llm: EngineClient) -> None:
        self.llm = llm

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.llm.scheduler_stats
        for name, doc, value in (
            (
                "guidespec_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            (
                "guidespec_prefix_cache_hits",
                "Prompt tokens found in the prefix cache (not computed)",
                stats.prefix_cache_hits,
            ),
            (
                "guidespec_num_preemptions",
                "Requests sent back to the queue for want of KV blocks",
                stats.num_preemptions,
            ),
            ("guidespec_grammars_compiled", "Grammars compiled", stats.grammars_compiled),
            (
                "guidespec_grammars_shared",
                "Grammars found compiled by another engine (data-parallel replicas' shared store): not compiled",
                stats.grammars_shared,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
