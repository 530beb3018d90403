"""Prometheus metrics of the plugin, exported on vLLM's own ``/metrics``.

vLLM serves ``prometheus_client``'s default registry (or the multiprocess collector when
``PROMETHEUS_MULTIPROC_DIR`` is set, which these metrics also follow), so registering here is all
it takes. Names (``_total`` is appended to counters by prometheus_client):

- ``mmref_resolve_seconds{kind}``: time to resolve one ref on a cache miss (read, hash, decode,
  process, encode), ``kind`` = ``mmraw`` | ``mmfile``.
- ``mmref_cache_hits_total`` (answered from the cache or by joining an in-flight resolve),
  ``mmref_cache_misses_total``, ``mmref_cache_evictions_total``, ``mmref_cache_bytes``,
  ``mmref_cache_entries``: read from the cache's own counters at scrape time (not aggregated
  across API-server processes in vLLM's multiprocess mode: each has its own cache).
- ``mmref_ref_errors_total{code}``: refused requests by error code.
- ``mmref_images_materialized_total``: images read and run through the processor (cache misses
  that succeeded).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = [
    "IMAGES_MATERIALIZED",
    "REF_ERRORS",
    "RESOLVE_SECONDS",
    "register_cache",
]

RESOLVE_SECONDS = Histogram(
    "mmref_resolve_seconds",
    "Seconds to resolve one ref on a cache miss (read, sha256, decode, process, encode).",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
REF_ERRORS = Counter("mmref_ref_errors", "Requests refused by the plugin, by error code.", ["code"])
IMAGES_MATERIALIZED = Counter(
    "mmref_images_materialized", "Images read and processed by the server (successful cache misses)."
)


class _CacheCollector:
    """Exports a resolve cache's :class:`~vllm_plugin.cache.CacheStats` at scrape time."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def collect(self):
        s = self.cache.stats
        yield CounterMetricFamily(
            "mmref_cache_hits", "Refs answered from the resolve cache.", s.hits + s.joined
        )
        yield CounterMetricFamily(
            "mmref_cache_misses", "Refs resolved (once per ref: single-flight).", s.misses
        )
        yield CounterMetricFamily("mmref_cache_evictions", "Entries evicted by the byte budget.", s.evictions)
        yield GaugeMetricFamily("mmref_cache_bytes", "Bytes held by the resolve cache.", s.bytes)
        yield GaugeMetricFamily("mmref_cache_entries", "Entries in the resolve cache.", s.entries)


_registered: list[_CacheCollector] = []


def register_cache(cache: Any) -> None:
    """Export ``cache``'s counters (one cache per process: a later call replaces the earlier one)."""
    for old in _registered:
        REGISTRY.unregister(old)
    _registered[:] = [_CacheCollector(cache)]
    REGISTRY.register(_registered[0])
