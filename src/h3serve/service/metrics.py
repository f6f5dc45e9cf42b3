"""Prometheus metrics of one service instance (its own registry: no process-global state)."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from h3serve.pipeline.engine import STAGES, RenderResult
from h3serve.service.store.claims import StoreUnreachable

RENDER_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 2400, 4800, 9600)
# An adapter switch copies factors into the device buffers (and reads a file the host cache gave up): milliseconds to
# seconds.
SWITCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.renders = Counter("h3serve_renders", "Renders finished, by outcome", ["outcome"], registry=self.registry)
        self.render_seconds = Histogram(
            "h3serve_render_seconds", "Engine time of completed renders", buckets=RENDER_BUCKETS, registry=self.registry
        )
        self.stage_seconds = Histogram(
            "h3serve_stage_seconds", "Time per stage of completed renders", ["stage"], buckets=RENDER_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.rejected = Counter(
            "h3serve_rejected_requests", "Render requests refused, by reason", ["reason"], registry=self.registry
        )
        # Step caching, counted by the step cache (so only on a server with one): DiT forwards the completed renders
        # ran, and those of them that reused cached blocks. cached / forwards is the share of forwards skipped.
        self.dit_forwards = Counter(
            "h3serve_dit_forwards", "DiT forwards run by completed renders (with a step cache)", registry=self.registry
        )
        self.dit_forwards_cached = Counter(
            "h3serve_dit_forwards_cached", "DiT forwards that reused cached blocks (step cache)", registry=self.registry
        )
        # Run-time adapters (H3_ADAPTERS), on a server that declares them: completed renders by adapter (names the
        # operator declared, so the labels are bounded), the seconds each render's switch took, and the renders whose
        # switch read an adapter from disk again (the host cache, H3_ADAPTER_CACHE_GIB, had given it up).
        self.adapter_renders = Counter(
            "h3serve_adapter_renders", "Completed renders that applied each run-time adapter", ["adapter"],
            registry=self.registry,
        )  # fmt: skip
        self.adapter_switch_seconds = Histogram(
            "h3serve_adapter_switch_seconds", "Time completed renders took to switch run-time adapters",
            buckets=SWITCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.adapter_reads = Counter(
            "h3serve_adapter_reads", "Completed renders that read a run-time adapter from disk again",
            registry=self.registry,
        )  # fmt: skip
        self.queue_depth = Gauge("h3serve_queue_depth", "Renders waiting for the GPU", registry=self.registry)
        self.ready = Gauge("h3serve_ready", "1 once the startup warmup has passed", registry=self.registry)
        # A fleet (a PostgreSQL store): the jobs this server holds now, and the cancels of held jobs other servers'
        # DELETEs asked for, by how they came (a notice at once, or a heartbeat that found one the notice missed).
        self.jobs_held = Gauge("h3serve_jobs_held", "Fleet jobs this server holds now (rendering or encoding)",
                               registry=self.registry)  # fmt: skip
        self.fleet_cancels = Counter(
            "h3serve_fleet_cancels", "Held jobs cancelled by another server's DELETE, by how the cancel came", ["via"],
            registry=self.registry,
        )  # fmt: skip
        self._job_counts = None

    def watch(self, scheduler, store) -> None:
        """Read the live values (queue depth, readiness, jobs by state) from the scheduler and store at scrape."""
        self.queue_depth.set_function(lambda: scheduler.depth)
        self.ready.set_function(lambda: 1.0 if scheduler.ready else 0.0)
        self.jobs_held.set_function(lambda: len(scheduler.held()))
        fleet = scheduler.fleet

        class Jobs:
            """The store's counts at scrape; in a fleet, the jobs each server holds. Nothing of either while the
            fleet's database does not answer (h3serve_ready says so): a scrape never fails for it."""

            def collect(self):
                try:
                    counts = store.counts()
                    holders = fleet.holders() if fleet is not None else None
                except StoreUnreachable:
                    return
                family = GaugeMetricFamily("h3serve_jobs", "Async jobs in the store, by state", labels=["state"])
                for state, count in counts.items():
                    family.add_metric([state], count)
                yield family
                if holders is not None:
                    held = GaugeMetricFamily(
                        "h3serve_fleet_jobs_held",
                        "Fleet jobs in progress, by the server that holds them",
                        labels=["server"],
                    )
                    for server, count in sorted(collections.Counter(holders.values()).items()):
                        held.add_metric([server], count)
                    yield held

        self.registry.register(Jobs())

    def render_finished(self, outcome: str, result: RenderResult | None) -> None:
        self.renders.labels(outcome).inc()
        if result is not None:
            self.render_seconds.observe(result.timings["total"])
            for stage in STAGES:
                self.stage_seconds.labels(stage).observe(result.timings[stage])
            if result.step_cache is not None:
                self.dit_forwards.inc(result.step_cache.forwards)
                self.dit_forwards_cached.inc(result.step_cache.num_cached)
            for name, _ in result.request.adapters:
                self.adapter_renders.labels(name).inc()
            if "adapters" in result.timings:  # a server that declares adapters (a render without any switches too)
                self.adapter_switch_seconds.observe(result.timings["adapters"])
            if "adapter_reads" in result.timings:
                self.adapter_reads.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
