"""serve's Prometheus metrics: one registry per serve process.

prometheus_client gives a correct exposition format (escaping, histograms)
that hand-written text would only approximate. Names follow Prometheus'
conventions: the unit in the name (`_seconds`, `_bytes`), counters end in
`_total` (prometheus_client adds it). Labels take only values from fixed sets
(states, error codes, known endpoints, gc reasons) or name the repositories
the root holds (seeding, read from their records at each scrape), so no
request can grow /metrics. The store's gauges are filled when serve starts
and after every gc, so an alert on free disk never sees a zero at a restart.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from checkoutcache.bundles.seed import REASONS
from checkoutcache.store import records
from checkoutcache.store.layout import RootPaths

__all__ = ["Metrics", "CONTENT_TYPE_LATEST", "generate_latest", "SEED_OUTCOMES"]
# No `_created` series: a scrape's worth of noise no alert uses.
disable_created_metrics()
SEED_OUTCOMES = ("seeded", "partial", "none")
SEED_REASONS = ("", *REASONS)  # "": every listed bundle taken in
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 120, 600)


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
        size = GaugeMetricFamily("checkoutcache_upstream_since_seed_bytes",
                                 "Bytes fetched from upstream into a seeded mirror since seeding", labels=["repo"])
        for key in self.root_paths.repo_keys():
            try:
                record = records.read_json(self.root_paths.repo(key).seed_record, records.SEED)
            except OSError:
                continue  # a record a peer made unreadable: that repository is left out of this scrape
            if record is None:
                continue
            bundles = record.get("bundles") or []
            seeded.add_metric([key, str(bundles[-1]) if bundles else ""], 1.0 if record.get("seeded") else 0.0)
            upstream = record.get("upstream")
            if isinstance(upstream, dict):
                objects.add_metric([key], float(upstream.get("objects", 0) or 0))
                size.add_metric([key], float(upstream.get("bytes", 0) or 0))
        return [seeded, objects, size]


class Metrics:
    def __init__(self, root_paths: RootPaths | None = None, version: str = "unknown"):
        self.registry = CollectorRegistry()
        r = self.registry
        if root_paths is not None:
            r.register(SeedCollector(root_paths))
        Info("checkoutcache_build", "The running checkoutcache", registry=r).info({"version": version})
        self.answers = Counter("checkoutcache_answers", "Answers to ensure and hold, by state and error code",
                               ["state", "error"], registry=r)
        self.requests = Histogram("checkoutcache_request_duration_seconds", "HTTP request latency by endpoint",
                                  ["endpoint"], registry=r, buckets=LATENCY_BUCKETS)
        self.refused = Counter("checkoutcache_requests_refused", "Requests refused before any work, by why",
                               ["why"], registry=r)
        self.clones = Counter("checkoutcache_clones", "Clones started by this sidecar, by outcome",
                              ["outcome", "error"], registry=r)
        self.clone_seconds = Histogram("checkoutcache_clone_duration_seconds", "Clone durations (published ones)",
                                       registry=r, buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.evictions = Counter("checkoutcache_evictions", "Removals by gc, by reason", ["reason"], registry=r)
        self.gc_runs = Counter("checkoutcache_gc_runs", "gc runs, by result", ["result"], registry=r)
        self.gc_failing = Gauge("checkoutcache_scheduled_gc_failures", "Scheduled gc runs failed in a row (0: the last "
                                "one ran)", registry=r)
        self.gc_seconds = Histogram("checkoutcache_gc_duration_seconds", "gc durations", registry=r)
        self.checkouts = Gauge("checkoutcache_checkouts", "Checkouts in the store (at start and after each gc)",
                               registry=r)
        self.bytes = Gauge("checkoutcache_checkouts_bytes", "Bytes of checkouts (at start and after each gc)",
                           registry=r)
        self.limit = Gauge("checkoutcache_limit", "Configured limits (absent when unlimited)", ["limit"], registry=r)
        self.disk_free = Gauge("checkoutcache_disk_free_bytes", "Free bytes on the root's filesystem", registry=r)
        self.disk_total = Gauge("checkoutcache_disk_size_bytes", "Size of the root's filesystem", registry=r)
        self.seeds = Counter("checkoutcache_bundle_seeds", "New mirrors made by this sidecar's workers, by how "
                             "seeding from bundles went (seeded, partial, none) and why not wholly (reason)",
                             ["outcome", "reason"], registry=r)
        self.holds = Gauge("checkoutcache_holds", "Checkouts held through /v1/hold", registry=r)
        self.waiting = Gauge("checkoutcache_requests_waiting", "Requests waiting on a clone", registry=r)
        self._children: dict = {}  # labelled children, looked up once: these run for every request

    def answer(self, state: str, error: str) -> None:
        child = self._children.get(("answer", state, error))
        if child is None:
            child = self._children[("answer", state, error)] = self.answers.labels(state, error)
        child.inc()

    def request(self, endpoint: str, seconds: float) -> None:
        child = self._children.get(("request", endpoint))
        if child is None:
            child = self._children[("request", endpoint)] = self.requests.labels(endpoint)
        child.observe(seconds)
