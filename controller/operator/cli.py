"""`moeless operator`: run the ExpertAutoscalingPolicy operator (registered by moeless.cli)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "operator",
        help="run the Kubernetes operator of ExpertAutoscalingPolicy resources",
        description="Reconcile ExpertAutoscalingPolicy and ExpertPool resources (moeless.io/v1alpha1, `kubectl get "
        "eap`, `kubectl get epool`): size each policy's (or shared pool's) expert-host StatefulSet, write each "
        "policy's serving and placement ConfigMaps, read the hosts' meters into their status (per model on a "
        "shared pool). Runs until SIGTERM. Needs the CRDs (manifests/crd.yaml) installed.",
    )
    add = parser.add_argument
    add("--kubeconfig", metavar="PATH", help="kubeconfig file (default: in-cluster config, else $KUBECONFIG or ~/.kube/config)")
    add("--namespace", metavar="NS", help="watch only this namespace (default: all namespaces)")
    add("--resync-s", type=float, default=10.0, metavar="S", help="seconds between passes over all policies (default 10)")
    add("--metrics-port", type=int, default=8080, metavar="P",
        help="serve Prometheus /metrics on this port, 0 for none (default 8080)")
    add("--metrics-bind", default="0.0.0.0", metavar="ADDR", help="address of /metrics (default 0.0.0.0)")
    add("--no-leader-elect", dest="leader_elect", action="store_false",
        help="act without holding the lease (only one operator may run)")
    add("--lease-namespace", metavar="NS",
        help="namespace of the Lease moeless-operator (default: $POD_NAMESPACE, else --namespace, else default)")
    add("--identity", default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the lease (default: $POD_NAME or the host name)")
    add("-v", "--verbose", action="store_true", help="log every action")
    parser.set_defaults(func=_run)


def _api_client(kubeconfig: str | None):
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return config.new_client_from_config(config_file=path)


def _run(args: argparse.Namespace) -> int:
    from kubernetes.config import ConfigException
    from prometheus_client import start_http_server

    # heavy (kubernetes, prometheus_client): kept off --help's start-up path
    from moeless.controller.operator.kube import Kube
    from moeless.controller.operator.leader import LeaderElector
    from moeless.controller.operator.loop import Operator

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.WARNING)  # one line per request otherwise
    if args.resync_s <= 0:
        print("moeless operator: --resync-s must be > 0", file=sys.stderr)
        return 2
    try:
        api = _api_client(args.kubeconfig)
    except (FileNotFoundError, ConfigException) as err:
        print(f"moeless operator: no cluster configuration ({err}); pass --kubeconfig PATH or run in a pod",
              file=sys.stderr)
        return 2
    kube = Kube(api)
    elector = None
    if args.leader_elect:
        lease_ns = args.lease_namespace or os.environ.get("POD_NAMESPACE") or args.namespace or "default"
        elector = LeaderElector(kube, lease_ns, "moeless-operator", args.identity, time.time)
    operator = Operator(kube, namespace=args.namespace, resync_s=args.resync_s, elector=elector)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_bind, registry=operator.metrics.registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("moeless.operator").info(
        "operator %s watching %s (resync %.0f s, leader election %s)", args.identity,
        args.namespace or "all namespaces", args.resync_s, "on" if elector else "off")
    operator.run(stop)
    return 0
