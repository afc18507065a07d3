"""`moeless serve`: the whole serving path on one machine.

1. Load the model (the default one is built and cached on first use) and export its experts to a
   weight store in the cache directory (reused while the experts are unchanged).
2. Start the expert hosts as local processes over that store (with MOELESS_EXPERT_HOSTS set:
   use those hosts instead, started elsewhere, e.g. the Helm chart's pool). Serving follows the
   pool (controller/pool/sources.py): the local hosts' supervisor publishes them to a pool file.
3. Start local Ray (replicas with fractional CPUs), the Serve app and its planning loop (the
   knobs: planner, predictor, distance, keep-alive, ...; controller/planning/actor.py); print the URL. A
   supervisor restarts a local host that dies (with back-off); meanwhile the others serve its experts.
4. With --demo send one short chat request, print the answer and shut everything down;
   otherwise serve until SIGINT (Ctrl-C) or SIGTERM.
5. Shutting down: stop admitting (new requests get a 503), let running requests finish for up
   to drain_s and fail the rest with a 503 that says so, stop Serve and Ray, then drain and stop
   the expert hosts; return normally (exit status 0), leaving no process behind.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from moeless.controller.knobs import KnobError, Knobs
from moeless.controller.planning.names import BOARD_NAME, LOOP_NAME, NAMESPACE
from moeless.controller.planning.rules import layer_cap_replicas, live_planner_name
from moeless.controller.pool.addresses import HOSTS_ENV
from moeless.controller.pool.sources import FileSource, pool_source, write_members
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import export_store
from moeless.serving.app import build_app
from moeless.serving.config import ServeConfig, choose_model, replica_gpus_for
from moeless.serving.scheduler import BatchLimits
from moeless.serving.shutdown import SIGNAL_NAME, drain_replicas
from moeless.serving.supervisor import HostSupervisor

DEMO_QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_embedded(model: str | list[str] = "default", *, hosts: int = 2, replicas: int = 1, port: int = 8000,
                   bind: str = "127.0.0.1", knobs=None, profile=None, predictor_file: str | None = None, batching: str = "continuous",
                   limits=None, max_batch: int = 8, drain_s: float = 30.0, demo: bool = False, poll_s: float = 0.0,
                   knob_file: str | None = None, transport: str = "auto", micro_batches: int = 1,
                   micro_batch_tokens: int = 256, demo_question: str = DEMO_QUESTION, demo_tokens: int = 40,
                   device: str = "cpu", step: dict | None = None) -> str | None:
    """Run the serving path locally (see the module docstring); returns the demo's answer. Several
    models (a list) share the local expert hosts, each with its own servers and planning loop, each
    answering by its name; the demo asks the first.
    knobs: moeless.controller.knobs.Knobs (default: the defaults); profile: a CostProfile (default: measured
    at start); poll_s: the data plane's busy-poll, in the clients and the local hosts (expert_fn/wire/polling.py);
    knob_file: the knobs' YAML (`--config`), followed while serving: an edit reaches the loop within seconds;
    transport: how the clients reach the hosts (expert_fn/client/client.py: auto, local, tcp or grpc);
    micro_batches, micro_batch_tokens: ping-pong in continuous batching (ServeConfig); device: where
    the replicas run the non-expert layers ("cpu" or "cuda": a GPU each, or a share where there are
    fewer; the local expert hosts take GPU 0 where there is one, as `moeless expert-host` does);
    step: the step scaler's ServeConfig fields (step_slo_s, step_slos_s: any model's own, step_hosts,
    step_hold_s, step_admit; None: off).
    Raises KnobError for knobs that do not fit the model (before anything starts)."""
    models = [model] if isinstance(model, str) else list(model)
    replica_gpus = replica_gpus_for(device, replicas * len(models))
    import httpx
    import ray
    from ray import serve

    _quiet_ray_logs()  # after importing Serve: the import sets its logger's level

    base_knobs = knobs or Knobs()
    remote = pool_source(os.environ[HOSTS_ENV]) if os.environ.get(HOSTS_ENV) else None
    choices = [choose_model(name) for name in models]
    unserved = [m for m, _ in (step or {}).get("step_slos_s", ()) if m not in {c.name for c in choices}]
    if unserved:
        raise KnobError(f"--step-slo-ms {unserved[0]}=MS: no --model {unserved[0]} is served "
                        f"(served: {', '.join(c.name for c in choices)})")
    if remote and (len(choices) > 1 or getattr(remote, "family", ())):
        _check_remote_family(choices, remote)
    stop = _stop_on_signals()
    # 1. Each model (its knobs checked) and its weight store; a fine-tune's over its base's (written
    #    first, served or not), so the hosts hold each expert they share once.
    served = []  # (choice, spec, knobs, store)
    written: dict[str, Path] = {}
    for choice in choices:
        print(f"loading model {choice.name} ...", flush=True)
        loaded = (choice.first_load or choice.loader)()
        served.append((choice, loaded.spec, _knobs_for(base_knobs, loaded.spec),
                       None if remote else _store(choice, loaded, written)))
        del loaded  # the replicas load their own copy (without experts)
    if len({choice.name for choice, *_ in served}) != len(served):
        raise KnobError(f"--model: each model once, got {[choice.name for choice, *_ in served]}")
    several = len(served) > 1
    choice, spec, knobs, _ = served[0]
    stores = None if remote else [(c.name, store) for c, _, _, store in served]
    # Several models: each is guaranteed its static replicas' memory on every host while active.
    shares = {c.name: math.ceil(s.num_layers * s.num_experts / hosts) * 3 * s.expert_ffn * s.hidden_size * 4 / 1e9
              for c, s, _, _ in served} if several else None
    # 2. Expert hosts: local ones kept running by the supervisor, or the remote ones given.
    with _hosts(stores, hosts, knobs.keep_alive_s, remote, poll_s, shares) as (pool, supervisor):
        try:
            # 3. Ray and the app.
            ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                     logging_level="WARNING")
            stop = _stop_on_signals(stop)  # again: Ray's start-up installs handlers of its own
            try:
                port = port or free_port()
                serve.start(http_options={"host": bind, "port": port})
                suffix = (lambda c: f"-{c.name}") if several else (lambda c: "")
                family = _families([c for c, *_ in served])  # ESFT (and experts-only LoRA) fine-tunes in their base's engine
                configs = [ServeConfig(c.name, c.loader, (), pool=pool, num_replicas=replicas, family=family[c.name],
                                       replica_cpus=0.5 / len(served), ingress_cpus=0.25, batching=batching,
                                       limits=limits or BatchLimits(), max_batch=max_batch,
                                       placement_board=BOARD_NAME + suffix(c), drain_signal=SIGNAL_NAME, knobs=k,
                                       plan_loop=LOOP_NAME + suffix(c), profile=profile if not several else None,
                                       predictor_file=predictor_file if not several else None,
                                       client_poll_s=poll_s, knob_file=knob_file, transport=transport,
                                       micro_batches=micro_batches, micro_batch_tokens=micro_batch_tokens,
                                       host_model=getattr(remote, "model", None) if remote else
                                       (c.name if several else None), family_hosts=getattr(remote, "family", ()),
                                       device=device, replica_gpus=replica_gpus,
                                       **_engine_step(step, (c.name, *family[c.name])))
                           for c, _, k, _ in served if c.name in family]
                serve.run(build_app(configs), name="moeless", route_prefix="/")
                url = f"http://127.0.0.1:{port}"
                for config in configs:
                    k = config.knobs
                    price = ray.get(ray.get_actor(config.plan_loop, namespace=NAMESPACE).state.remote())["memory_price"]
                    print(f"planning loop{' of ' + config.model_name if several else ''}: planner {k.planner}, predictor "
                          f"{k.predictor}, distance {k.distance}, keep-alive {k.keep_alive_s:g} s, memory price "
                          f"{price:.3g} s per GB·s" + (" (memory-neutral)" if k.memory_price is None else ""), flush=True)
                print(f"moeless is serving {', '.join(c.name for c, *_ in served)} at {url}  (OpenAI-style: "
                      f"/v1/completions, /v1/chat/completions; /healthz, /metrics)", flush=True)
                # 4. The demo request, or serve until a stop signal.
                if demo:
                    answer = _demo(httpx, url, choice.name, demo_question, demo_tokens)
                    _print_loop_summary(spec.num_layers * spec.num_experts, configs[0].plan_loop)
                    print(f"next: `moeless serve` keeps serving at {url} (OpenAI-style API; `moeless serve --help` "
                          "for the knobs); docs/serving.md and docs/evaluation.md say what it does", flush=True)
                    return answer
                print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                      f"'{{\"model\": \"{choice.name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                      f"\"Hi!\"}}], \"max_tokens\": 20}}'", flush=True)
                print("Ctrl-C (or SIGTERM) stops it.", flush=True)
                stop.wait()
                # 5. Drain the replicas while the HTTP side can still tell the clients.
                print(f"stopping: no new requests; running ones get up to {drain_s:g} s ...", flush=True)
                outcomes = drain_replicas(replicas * len(configs), drain_s)
                failed = sum(o.get("unfinished", 0) for o in outcomes.values())
                print(f"drained {len(outcomes)} of {replicas * len(configs)} replicas; {failed} requests ended unfinished "
                      "(their clients got a 503 saying so)", flush=True)
                time.sleep(0.5)  # the last responses leave the ingress
                return None
            finally:
                # Deleting the app (a graceful stop of its replicas) and then stopping Ray is quiet;
                # serve.shutdown() kills its controller mid-task and Ray prints that task as failed.
                with contextlib.suppress(Exception):
                    serve.delete("moeless")
                ray.shutdown()
        finally:
            if supervisor is not None:
                supervisor.stop()
                print("stopping the expert hosts ...", flush=True)


def _check_remote_family(choices: list, remote) -> None:
    """Several models on hosts from $MOELESS_EXPERT_HOSTS are one engine (serving/family.py): the first model
    and fine-tunes of it that change only experts, the pool's address naming what its hosts serve each
    fine-tune by (&family=, in --model's order). KnobError says what is not so."""
    base, tunes = choices[0], choices[1:]
    for c in tunes:
        if not (c.base is not None and c.base.name == base.name and c.joins_base):
            raise KnobError(f"--model {c.name}: on the expert hosts of ${HOSTS_ENV} several models are one engine, the "
                            f"first ({base.name}) and fine-tunes of it that change only experts (ESFT, a LoRA on "
                            "experts); serve this one in an app of its own")
    if not hasattr(remote, "family"):
        raise KnobError(f"${HOSTS_ENV}: several models on hosts given as a list need a pool's address instead "
                        f"(k8s://...&model=BASE&family=NAME,...: what its hosts serve each by); or unset ${HOSTS_ENV} to "
                        "serve them on local hosts")
    family = remote.family
    if len(family) != len(tunes):
        raise KnobError(f"${HOSTS_ENV} names {len(family)} fine-tunes of {base.name}'s engine (&family=NAME,...: what the "
                        f"pool's hosts serve them by), --model {len(tunes)} ({', '.join(c.name for c in tunes) or 'none'}): "
                        "give each fine-tune in both, in the same order")


def _engine_step(step: dict | None, members: tuple[str, ...]) -> dict:
    """The step scaler's ServeConfig fields of the engine serving `members` (its model, its fine-tunes):
    the own SLOs of those only."""
    if not step:
        return {}
    return {**step, "step_slos_s": tuple((m, slo) for m, slo in step.get("step_slos_s", ()) if m in members)}


def _families(choices: list) -> dict[str, tuple[str, ...]]:
    """Each engine's model -> the fine-tunes its engine serves too (serving/family.py: a fine-tune whose
    non-expert layers are its base's, ESFT or a LoRA on experts only, served beside its base); a model in
    another's engine has none."""
    names = {c.name for c in choices}
    joins = {c.name: c.base.name for c in choices if c.base is not None and c.joins_base and c.base.name in names}
    return {c.name: tuple(f.name for f in choices if joins.get(f.name) == c.name) for c in choices if c.name not in joins}


def _store(choice, model, written: dict[str, Path]) -> Path:
    """The model's weight store (cached), over its base's where it is a fine-tune; written: the stores
    so far by model name (a base's is written the first time a fine-tune needs it)."""
    base = None
    if choice.base is not None:
        base = written.get(choice.base.name)
        if base is None:
            base = _store(choice.base, choice.base.loader(), written)
    written[choice.name] = Path(export_store(model, choice.name, base=base))
    return written[choice.name]


def _knobs_for(knobs: Knobs, spec) -> Knobs:
    """The knobs for a model, checked against it (the default distance shortened on a tiny model)."""
    fitted = knobs.for_model(spec.num_layers)
    if fitted.distance != knobs.distance:
        print(f"distance: the default reaches past this model's {spec.num_layers} MoE layers; using {fitted.distance}",
              flush=True)
    knobs = fitted
    layer_cap_replicas(knobs, spec.num_experts, 3 * spec.expert_ffn * spec.hidden_size * 4)  # float32 replicas
    live_planner_name(knobs)
    return knobs


@contextlib.contextmanager
def _hosts(stores: list | None, count: int, keep_alive_s: float, remote, poll_s: float = 0.0,
           shares: dict[str, float] | None = None):
    """(the PoolSource serving follows, supervisor or None): `count` local hosts over `stores` ((model
    name, store) pairs, every host serving every model), published by their supervisor to a pool file,
    or the remote pool given (a PoolSource)."""
    if remote:
        fixed = getattr(remote, "addresses", None)
        print(f"using {len(fixed)} expert hosts from $MOELESS_EXPERT_HOSTS: {', '.join(fixed)}" if fixed else
              f"following the expert-host pool of $MOELESS_EXPERT_HOSTS ({remote.slots} slots): {remote}", flush=True)
        yield remote, None
        return
    print(f"starting {count} expert hosts over {', '.join(str(store) for _, store in stores)} ...", flush=True)
    with launch_local_hosts(count, stores if len(stores) > 1 else stores[0][1], keep_alive_s=keep_alive_s,
                            poll_s=poll_s, shares=shares) as group, \
            tempfile.TemporaryDirectory(prefix="moeless-pool-") as tmp:
        path = str(Path(tmp, "pool.json"))
        supervisor = HostSupervisor(group, publish=functools.partial(write_members, path, count))
        yield FileSource(path, count), supervisor


def _stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGINT or SIGTERM (instead of dying mid-way and leaving processes behind)."""
    stop = stop or threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            print(f"{signal.Signals(signum).name} again: still shutting down, please wait", flush=True)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop


def _quiet_ray_logs() -> None:
    """Keep Ray's start-up notes out of a first run: the token-auth note (auth stays on, Ray's default)
    and Serve's INFO lines (moeless prints its own URL). Warnings and errors still show."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def _print_loop_summary(static_replicas: int, loop: str = LOOP_NAME) -> None:
    """One line on what the planning loop did while the demo ran: replicas added (or why none) and GB·s."""
    import ray

    m = ray.get(ray.get_actor(loop, namespace=NAMESPACE).metrics.remote())
    added = max(0, int(m["resident_replicas"]) - static_replicas)
    did = (f"added {added} replicas beyond static EP's {static_replicas}" if added else
           f"stayed on static EP's {static_replicas} replicas: no extra replica paid for its cold start")
    print(f"planning loop: {m['passes']} passes over {m['reports']} iteration reports, {did}; "
          f"{m['cold_starts']} replica loads from the store, the static replicas' first ones included "
          f"({m['cold_exposed_s']:.2f} s on the critical path); memory held "
          f"{m['expert_gb_s']:.3g} GB·s experts + {m['non_expert_gb_s']:.3g} GB·s non-expert", flush=True)


def _demo(httpx, url: str, model: str, question: str, tokens: int) -> str:
    doc = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": tokens}
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", json=doc, timeout=300)
    if reply.status_code != 200:
        raise SystemExit(f"demo request failed: HTTP {reply.status_code}: {reply.text}")
    body = reply.json()
    answer = body["choices"][0]["message"]["content"]
    print(f"\nuser: {question}\nassistant: {answer}\n({body['usage']['completion_tokens']} tokens in "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
    return answer
