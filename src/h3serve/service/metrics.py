"""Prometheus metrics of one service instance (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from h3serve.pipeline.engine import STAGES, RenderResult

RENDER_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 2400, 4800, 9600)


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
        self.queue_depth = Gauge("h3serve_queue_depth", "Renders waiting for the GPU", registry=self.registry)
        self.ready = Gauge("h3serve_ready", "1 once the startup warmup has passed", registry=self.registry)
        self._job_counts = None

    def watch(self, scheduler, store) -> None:
        """Read the live values (queue depth, readiness, jobs by state) from the scheduler and store at scrape."""
        self.queue_depth.set_function(lambda: scheduler.depth)
        self.ready.set_function(lambda: 1.0 if scheduler.ready else 0.0)

        class Jobs:
            def collect(self):
                family = GaugeMetricFamily("h3serve_jobs", "Async jobs in the store, by state", labels=["state"])
                for state, count in store.counts().items():
                    family.add_metric([state], count)
                yield family

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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
