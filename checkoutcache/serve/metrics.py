"""serve's Prometheus metrics: one registry per serve process.

prometheus_client gives a correct exposition format (escaping, histograms)
that hand-written text would only approximate. Labels take only values from
fixed sets (states, error codes, known endpoints, gc reasons), so no request
can grow /metrics.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE_LATEST", "generate_latest"]


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.answers = Counter("checkoutcache_answers", "Answers to ensure, by state and error code",
                               ["state", "error"], registry=r)
        self.requests = Histogram("checkoutcache_request_seconds", "HTTP request latency by endpoint",
                                  ["endpoint"], registry=r,
                                  buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        self.clones = Counter("checkoutcache_clones", "Clones started by this sidecar, by outcome",
                              ["outcome", "error"], registry=r)
        self.clone_seconds = Histogram("checkoutcache_clone_seconds", "Clone durations (published ones)",
                                       registry=r, buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.evictions = Counter("checkoutcache_evictions", "Removals by gc, by reason", ["reason"], registry=r)
        self.gc_runs = Counter("checkoutcache_gc_runs", "gc runs, by result", ["result"], registry=r)
        self.gc_seconds = Histogram("checkoutcache_gc_seconds", "gc durations", registry=r)
        self.checkouts = Gauge("checkoutcache_checkouts", "Checkouts in the store (at the last gc)", registry=r)
        self.bytes = Gauge("checkoutcache_checkout_bytes", "Bytes of checkouts (at the last gc)", registry=r)
        self.limit = Gauge("checkoutcache_limit", "Configured limits (absent when unlimited)", ["limit"], registry=r)
        self.disk_free = Gauge("checkoutcache_disk_free_bytes", "Free bytes on the root's filesystem", registry=r)
        self.holds = Gauge("checkoutcache_holds", "Checkouts held through /v1/hold", registry=r)
