"""MOELESS_EXPERT_HOSTS (controller/pool/addresses.py): a headless Service's pods by their stable names in
ordinal order, addresses as the fallback, one clear error per bad entry. DNS is injected."""

import socket

import pytest

from moeless.controller.knobs import KnobError
from moeless.controller.pool.addresses import expert_hosts

SERVICE = "p-hosts.ml.svc"
PODS = {"10.0.0.7": "p-hosts-2.p-hosts.ml.svc.cluster.local", "10.0.0.9": "p-hosts-0.p-hosts.ml.svc.cluster.local",
        "10.0.0.3": "p-hosts-10.p-hosts.ml.svc.cluster.local"}


def resolve(name, port, type=None):
    if name != SERVICE:
        raise socket.gaierror(-2, "Name or service not known")
    return [(socket.AF_INET, type, 6, "", (a, port)) for a in PODS]


def reverse_of(table):
    def reverse(address):
        if address not in table:
            raise socket.herror(1, "Unknown host")
        return table[address], [], [address]
    return reverse


def test_a_statefulsets_pods_are_used_by_name_in_ordinal_order():
    hosts = expert_hosts(f"dns:///{SERVICE}:50051", resolve, reverse_of(PODS))
    assert hosts == ("p-hosts-0.p-hosts.ml.svc.cluster.local:50051", "p-hosts-2.p-hosts.ml.svc.cluster.local:50051",
                     "p-hosts-10.p-hosts.ml.svc.cluster.local:50051")


@pytest.mark.parametrize("table", [
    {a: n for a, n in PODS.items() if a != "10.0.0.3"},  # one address has no reverse record
    {**PODS, "10.0.0.3": "node-4.compute.internal"},  # one is not a pod of this Service
])
def test_without_a_pod_name_for_every_address_the_sorted_addresses_are_used(table):
    hosts = expert_hosts(f"dns:///{SERVICE}:50051", resolve, reverse_of(table))
    assert hosts == ("10.0.0.3:50051", "10.0.0.7:50051", "10.0.0.9:50051")


def test_plain_entries_keep_their_order_and_bad_ones_are_named():
    assert expert_hosts("b:2, a:1,", resolve, reverse_of(PODS)) == ("b:2", "a:1")
    with pytest.raises(KnobError, match="'nohost' is not host:port"):
        expert_hosts("nohost", resolve, reverse_of(PODS))
    with pytest.raises(KnobError, match="cannot resolve 'other.ml.svc'"):
        expert_hosts("dns:///other.ml.svc:50051", resolve, reverse_of(PODS))
    with pytest.raises(KnobError, match="names no expert host"):
        expert_hosts(" , ", resolve, reverse_of(PODS))
