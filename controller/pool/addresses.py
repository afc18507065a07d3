"""MOELESS_EXPERT_HOSTS: which expert hosts a serving app talks to, numbered alike in every replica.

    host:port[,host:port...]      the hosts, in this order (host i is GPU i of every placement)
    dns:///NAME:PORT              every address NAME resolves to (a headless Service)

Behind the operator's headless Service NAME-hosts stand the pods of a StatefulSet, and Kubernetes
DNS names each one (NAME-hosts-i.NAME-hosts.<namespace>.svc..., served for reverse lookups too).
Such a pod is used by that name, in ordinal order: host i is pod i, as the operator counts them,
and a pod that restarts with a new address is found again when gRPC re-resolves its name. Where
an address has no such name (no reverse record, or one outside NAME), the addresses are used,
sorted, so every serving replica still numbers the hosts alike. Either list is fixed once read;
a pool followed while serving (hosts joining and leaving) is `k8s://...` (controller/pool/sources.py).
"""

from __future__ import annotations

import logging
import socket
from typing import Callable

from moeless.controller.knobs import KnobError

log = logging.getLogger(__name__)
HOSTS_ENV = "MOELESS_EXPERT_HOSTS"
DNS = "dns:///"


def expert_hosts(value: str, resolve: Callable = socket.getaddrinfo,
                 reverse: Callable = socket.gethostbyaddr) -> tuple[str, ...]:
    """The host:port targets MOELESS_EXPERT_HOSTS names (see the module docstring); resolve and
    reverse are socket.getaddrinfo and socket.gethostbyaddr (injected in tests). KnobError names
    a bad entry or a name that does not resolve."""
    hosts: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        target = entry.removeprefix(DNS)
        name, sep, port = target.rpartition(":")
        if not sep or not name or not port.isdigit():
            raise KnobError(f"{HOSTS_ENV}: {entry!r} is not host:port (or {DNS}name:port)")
        hosts += _service_hosts(name, port, resolve, reverse) if entry.startswith(DNS) else [target]
    if not hosts:
        raise KnobError(f"{HOSTS_ENV} names no expert host; set it to host:port[,host:port...]")
    return tuple(hosts)


def _service_hosts(name: str, port: str, resolve: Callable, reverse: Callable) -> list[str]:
    try:
        found = sorted({info[4][0] for info in resolve(name, int(port), type=socket.SOCK_STREAM)})
    except OSError as err:
        raise KnobError(f"{HOSTS_ENV}: cannot resolve {name!r} ({err})") from None
    pods = [_pod_name(address, name, reverse) for address in found]
    if all(pods):
        return [f"{pod}:{port}" for pod in sorted(pods, key=_ordinal)]
    log.warning("%s: not every address of %s has a pod name behind it; using the addresses (a pod that "
                "restarts with a new one is not found again)", HOSTS_ENV, name)
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in found]


def _pod_name(address: str, service: str, reverse: Callable) -> str | None:
    """The name DNS gives `address` if it is one of `service`'s pods (POD.SERVICE...), else None."""
    try:
        host = reverse(address)[0]
    except OSError:
        return None
    _, _, domain = host.partition(".")
    return host if domain == service.rstrip(".") or domain.startswith(service.rstrip(".") + ".") else None


def _ordinal(pod: str) -> tuple[float, str]:
    """A StatefulSet pod's ordinal (NAME-3.... -> 3) first, then the name."""
    _, _, tail = pod.partition(".")[0].rpartition("-")
    return (int(tail) if tail.isdigit() else float("inf"), pod)
