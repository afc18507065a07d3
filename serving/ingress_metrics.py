"""The HTTP ingress' Prometheus metrics (serving/app.py's Ingress serves them at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class IngressMetrics:
    """The ingress' Prometheus metrics (own registry, so several apps in one process do not clash)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("moeless_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.tokens = Counter("moeless_generated_tokens", "completion tokens generated", registry=self.registry)
        self.latency = Histogram("moeless_request_seconds", "request latency (whole response)", ["route"],
                                 registry=self.registry)
        self.dead_hosts = Gauge("moeless_dead_expert_hosts", "expert hosts the serving path marked dead",
                                registry=self.registry)
        self.batch = Histogram("moeless_batch_size", "requests decoded together, per request",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.retries = Gauge("moeless_layer_retries", "MoE layers re-run after a host failure (one replica)",
                             registry=self.registry)
        self.running = Gauge("moeless_running_requests", "requests in the running batch (one replica)",
                             registry=self.registry)
        self.waiting = Gauge("moeless_waiting_requests", "requests queued for the running batch (one replica)",
                             registry=self.registry)
        self.refused = Gauge("moeless_refused_requests", "requests refused with 429 because the queue was full "
                             "(one replica)", registry=self.registry)
        self.split_forwards = Gauge("moeless_split_forwards", "forwards run as micro-batches in flight together "
                                    "(`--micro-batches`; one replica)", registry=self.registry)
        self.baton = Gauge("moeless_micro_batch_wait_seconds", "seconds micro-batches' gathered expert answers "
                           "waited while the other micro-batch computed (one replica)", registry=self.registry)
        self.waking = Gauge("moeless_pool_waking", "1 while requests wait for the expert-host pool to wake from zero "
                            "(one replica)", registry=self.registry)
        self.wakes = Gauge("moeless_pool_wakes", "wakes of the expert-host pool from zero this replica waited for",
                           registry=self.registry)
        self.wake_seconds = Gauge("moeless_pool_wake_seconds", "seconds the last wake took, from the first request "
                                  "that found the pool empty to a ready host (one replica)", registry=self.registry)
        self.model_wakes = Histogram("moeless_model_wake_seconds", "time to first token of a request that woke its "
                                     "model: it found nothing in flight and waited for cold starts or the pool's wake",
                                     ["model"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                                     registry=self.registry)
        self.model_wake_loads = Counter("moeless_model_wake_cold_starts", "replicas loaded for the first token of "
                                        "the requests that woke their model", ["model"], registry=self.registry)
        self.paths = Gauge("moeless_expert_host_path", "1 for the data path (local: shared memory, tcp, nixl, grpc) the "
                           "serving replica's calls to the expert host in this slot take", ["slot", "path"],
                           registry=self.registry)

        self.step_holds = Gauge("moeless_step_gate_holds", "admissions the step scaler held until the placement spanned "
                                "the hosts their step needs (all replicas)", registry=self.registry)
        self.step_wait = Gauge("moeless_step_gate_wait_seconds", "the step scaler's holds: the newcomers' admission wait, "
                               "by quantile (the worst replica's)", ["quantile"], registry=self.registry)
        self.step_switches = Gauge("moeless_step_gate_switches", "widenings the step scaler ran at once on the loop's "
                                   "standby placement, nobody held (all replicas)", registry=self.registry)
        self.step_slo = Gauge("moeless_step_slo_seconds", "the step SLO the step scaler prices a batch of this model "
                              "against, the least of its models' binding (model=\"*\": those without their own)",
                              ["model"], registry=self.registry)

    def set_step_gates(self, gates: list) -> None:
        """From the replicas' StepGate.figures() (None where a replica has no step scaler)."""
        gates = [g for g in gates if g]
        if gates:
            self.step_holds.set(sum(g["holds"] for g in gates))
            self.step_switches.set(sum(g["switches"] for g in gates))
            for q in ("p50", "p99", "max"):
                self.step_wait.labels(q).set(max(g[f"wait_{q}_s"] for g in gates))
            for g in gates:  # every replica of an engine has the same
                for model, slo_s in {"*": g["slo_s"], **g["slos_s"]}.items():
                    self.step_slo.labels(model).set(slo_s)

    def set_paths(self, paths: dict) -> None:
        """From a replica's stats: slot -> "local" | "tcp" | "nixl" | "grpc"."""
        self.paths.clear()
        for slot, path in paths.items():
            self.paths.labels(str(slot), path).set(1)

    def observe_wake(self, model: str, wake: dict) -> None:
        """A request woke `model` (ModelServer.generate): {"seconds": its time to first token, "cold_starts"}."""
        self.model_wakes.labels(model).observe(wake["seconds"])
        self.model_wake_loads.labels(model).inc(wake["cold_starts"])

    def set_wake(self, wake: dict | None) -> None:
        """From the replica's Waker.stats() (None: a pool that is not woken by requests)."""
        if wake:
            self.waking.set(float(wake["waking"]))
            self.wakes.set(wake["wakes"])
            self.wake_seconds.set(wake["last_wake_s"])
