"""serve's Prometheus metrics: one registry per serve process.

prometheus_client gives a correct exposition format (escaping, histograms)
that hand-written text would only approximate. Labels take only values from
fixed sets (states, error codes, known endpoints, gc reasons) or name the
repositories the root holds (seeding, read from their records at each
scrape), so no request can grow /metrics.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from checkoutcache.bundles.seed import REASONS
from checkoutcache.store import records
from checkoutcache.store.layout import RootPaths

__all__ = ["Metrics", "CONTENT_TYPE_LATEST", "generate_latest", "SEED_OUTCOMES"]
SEED_OUTCOMES = ("seeded", "partial", "none")
SEED_REASONS = ("", *REASONS)  # "": every listed bundle taken in


class SeedCollector:
    """Per repository: whether its mirror was seeded, from which bundle, and what
    upstream sent since (state/mirror-seed.json, read at each scrape)."""

    def __init__(self, root_paths: RootPaths):
        self.root_paths = root_paths

    def collect(self):
        seeded = GaugeMetricFamily("checkoutcache_mirror_seeded",
                                   "1 if the repository's mirror began from bundles (bundle: the newest taken in)",
                                   labels=["repo", "bundle"])
        objects = GaugeMetricFamily("checkoutcache_upstream_objects_since_seed",
                                    "Objects fetched from upstream into a seeded mirror since seeding", labels=["repo"])
        size = GaugeMetricFamily("checkoutcache_upstream_bytes_since_seed",
                                 "Bytes fetched from upstream into a seeded mirror since seeding", labels=["repo"])
        for key in self.root_paths.repo_keys():
            record = records.read_json(self.root_paths.repo(key).seed_record, records.SEED)
            if record is None:
                continue
            bundles = record.get("bundles") or []
            seeded.add_metric([key, str(bundles[-1]) if bundles else ""], 1.0 if record.get("seeded") else 0.0)
            upstream = record.get("upstream")
            if isinstance(upstream, dict):
                objects.add_metric([key], float(upstream.get("objects", 0)))
                size.add_metric([key], float(upstream.get("bytes", 0)))
        return [seeded, objects, size]


class Metrics:
    def __init__(self, root_paths: RootPaths | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        if root_paths is not None:
            r.register(SeedCollector(root_paths))
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
        self.seeds = Counter("checkoutcache_bundle_seeds", "New mirrors made by this sidecar's workers, by how "
                             "seeding from bundles went (seeded, partial, none) and why not wholly (reason)",
                             ["outcome", "reason"], registry=r)
        self.holds = Gauge("checkoutcache_holds", "Checkouts held through /v1/hold", registry=r)
