"""I/O: the service's Prometheus metrics, `sglang_farm_batch_*`, on their own registry
(served at `/metrics` by `api`)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge


class BatchMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Gauge(
            "sglang_farm_batch_requests",
            "Requests of each live batch by state (pending, in_flight, completed, failed)",
            ["batch", "state"],
            registry=r,
        )
        self.retries = Counter(
            "sglang_farm_batch_retries",
            "Attempts that will be tried again, by reason",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter(
            "sglang_farm_batch_tokens",
            "Tokens of the answers recorded (prompt, completion)",
            ["kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "sglang_farm_batch_in_flight", "Requests this service has in flight now", registry=r
        )
        self.target = Gauge(
            "sglang_farm_batch_concurrency_target",
            "Requests the runner keeps in flight (what the farm can serve now)",
            registry=r,
        )
        self.eta = Gauge(
            "sglang_farm_batch_eta_seconds",
            "Seconds until the batch is done at the recent rate",
            ["batch"],
            registry=r,
        )
        self.last_progress = Gauge(
            "sglang_farm_batch_last_progress_timestamp_seconds",
            "When a request of the batch last got its result (Unix time)",
            ["batch"],
            registry=r,
        )
        self.paused = Gauge(
            "sglang_farm_batch_paused",
            "1 while the runner is paused (the store's disk is full)",
            registry=r,
        )
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind=kind)

    def forget(self, batch_id: str) -> None:
        for state in ("pending", "in_flight", "completed", "failed"):
            with contextlib.suppress(KeyError):
                self.requests.remove(batch_id, state)
        for g in (self.eta, self.last_progress):
            with contextlib.suppress(KeyError):
                g.remove(batch_id)
