"""Pure parts of the operator's shell: the Lease rule, where a host's /metrics is, the meters'
parser on a real host's exposition, `moeless operator`'s usage errors, a pass that outlives one
owner's unexpected error, and the host pods' namespaces for CUDA IPC."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from kubernetes.client.rest import ApiException
from prometheus_client import generate_latest

from moeless.controller.operator.actions import Observed
from moeless.controller.operator.kube import metrics_url
from moeless.controller.operator.leader import lease_step, micro_time, parse_micro_time
from moeless.controller.operator.loop import Operator
from moeless.controller.operator.meters import parse_host_metrics
from moeless.controller.operator.objects import TEMPLATE_HASH, host_command, pod_template, stateful_set
from moeless.controller.operator.pool_spec import parse_pool_spec
from moeless.controller.operator.spec import SpecError, parse_spec

T0 = 1_700_000_000.0


def test_lease_taken_renewed_respected_and_taken_over_when_expired():
    mine = lease_step(None, "a", T0, 15)
    assert mine["holderIdentity"] == "a" and mine["leaseTransitions"] == 0
    assert parse_micro_time(mine["renewTime"]) == T0
    renewed = lease_step(mine, "a", T0 + 5, 15)
    assert renewed["renewTime"] == micro_time(T0 + 5) and renewed["acquireTime"] == mine["acquireTime"]
    assert lease_step(renewed, "b", T0 + 19, 15) is None  # a renewed 14 s ago: b follows
    taken = lease_step(renewed, "b", T0 + 21, 15)  # expired: b takes it
    assert taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 1
    released = dict(renewed, holderIdentity=None)
    assert lease_step(released, "b", T0 + 6, 15)["holderIdentity"] == "b"  # released: at once


def test_metrics_url_waits_for_ready_and_offsets_ports_on_the_node_network():
    pod = {"metadata": {"name": "mix-hosts-3"},
           "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert metrics_url(pod, 9400, host_network=False) == "http://10.0.0.7:9400/metrics"
    assert metrics_url(pod, 9400, host_network=True) == "http://10.0.0.7:9403/metrics"
    pending = {"metadata": {"name": "mix-hosts-0"}, "status": {"podIP": "10.0.0.8"}}
    assert metrics_url(pending, 9400, host_network=False) is None


def test_host_command_matches_the_expert_host_flags():
    spec = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "memoryGiBPerHost": 1},
                       "serving": {"keepAliveSeconds": 90}})
    argv = host_command(spec)
    assert argv[:2] == ["moeless", "expert-host"]
    from moeless.cli import build_parser

    args = build_parser().parse_args(argv[1:])  # the real CLI accepts exactly this
    assert (args.store, args.keep_alive_s, args.memory_gb, args.metrics_port) == (["/s"], 90.0, 1.074, 9400)
    assert args.poll_us == 0  # the host's default: no flag unless the policy sets one
    polling = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "pollMicroseconds": 250}})
    assert build_parser().parse_args(host_command(polling)[1:]).poll_us == 250


def test_family_warmth_is_on_unless_the_hosts_turn_it_off():
    from moeless.cli import build_parser

    plain = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2}})
    off = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "familyWarm": False}})
    assert "--no-family-warm" not in host_command(plain) and build_parser().parse_args(host_command(plain)[1:]).family_warm
    assert not build_parser().parse_args(host_command(off)[1:]).family_warm
    with pytest.raises(SpecError, match=r"spec.hosts.familyWarm: expected bool, got 'no'"):
        parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "familyWarm": "no"}})


def test_peer_copies_are_measured_unless_the_hosts_say_otherwise_and_a_bad_mode_is_refused_naming_the_field():
    from moeless.cli import build_parser

    plain = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2}})
    off = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "peerCopies": "off"}})
    assert "--peer-copies" not in host_command(plain)
    assert build_parser().parse_args(host_command(plain)[1:]).peer_copies == "measured"
    assert build_parser().parse_args(host_command(off)[1:]).peer_copies == "off"
    with pytest.raises(SpecError, match=r"spec.hosts.peerCopies: 'sometimes'; use one of measured, always, off"):
        parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "peerCopies": "sometimes"}})
    with pytest.raises(SpecError, match=r"spec.hosts.peerCopies: expected str, got False"):  # YAML's bare off
        parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "peerCopies": False}})


def test_a_compute_dtype_reaches_the_host_command_and_a_bad_one_is_refused_naming_the_field():
    from moeless.cli import build_parser

    plain = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2}})
    narrow = parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "computeDtype": "store"}})
    assert build_parser().parse_args(host_command(plain)[1:]).compute_dtype == "float32"
    assert build_parser().parse_args(host_command(narrow)[1:]).compute_dtype == "store"
    with pytest.raises(SpecError, match=r"spec.hosts.computeDtype: 'bfloat16'; use one of float32, store"):
        parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "computeDtype": "bfloat16"}})


def test_a_poll_outside_its_range_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"spec.hosts.pollMicroseconds: -1 is outside"):
        parse_spec({"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, "pollMicroseconds": -1}})


def _hosts_spec(**hosts) -> dict:
    return {"model": {"store": "/s"}, "hosts": {"image": "i", "maxHosts": 2, **hosts}}


@pytest.mark.parametrize("kind", ["ExpertAutoscalingPolicy", "ExpertPool"])
def test_cuda_ipc_puts_the_host_pods_in_the_node_s_pid_and_ipc_namespaces_and_a_change_rolls_them(kind):
    parse = parse_spec if kind == "ExpertAutoscalingPolicy" else (lambda s: parse_pool_spec({"hosts": s["hosts"]}))
    owner = {"kind": kind, "metadata": {"name": "mix", "namespace": "ml", "uid": "u"}}
    ipc = pod_template(owner, parse(_hosts_spec(hostNetwork=True, cudaIpc=True)))["spec"]
    assert (ipc["hostPID"], ipc["hostIPC"], ipc["hostNetwork"]) == (True, True, True)
    for plain in (_hosts_spec(), _hosts_spec(hostNetwork=True), _hosts_spec(hostNetwork=True, cudaIpc=False)):
        pod = pod_template(owner, parse(plain))["spec"]
        assert "hostPID" not in pod and "hostIPC" not in pod
    hashes = {stateful_set(owner, parse(_hosts_spec(hostNetwork=True, cudaIpc=on)), 1)["metadata"]["annotations"]
              [TEMPLATE_HASH] for on in (False, True)}
    assert len(hashes) == 2  # the hash covers it: turning it on or off restarts the hosts


@pytest.mark.parametrize("parse", [parse_spec, lambda s: parse_pool_spec({"hosts": s["hosts"]})])
def test_cuda_ipc_without_the_node_s_network_is_refused_naming_both_fields_and_the_remedy(parse):
    with pytest.raises(SpecError, match=r"spec.hosts.cudaIpc: needs spec.hosts.hostNetwork: .*abstract Unix socket.*"
                                        r"set hostNetwork: true too"):
        parse(_hosts_spec(cudaIpc=True))
    with pytest.raises(SpecError, match=r"spec.hosts.cudaIpc: expected bool, got 'yes'"):
        parse(_hosts_spec(hostNetwork=True, cudaIpc="yes"))


def test_meters_parser_reads_a_real_runtime_exposition(tmp_path):
    """The exposition of expert_fn.metrics over a real runtime with two replicas computed."""
    import torch

    from moeless.expert_fn.host.metrics import registry_for
    from moeless.expert_fn.host.runtime import ExpertHostRuntime
    from moeless.model.weight_store import WeightStore, export_experts

    gen = torch.Generator().manual_seed(0)
    weights = lambda: {"gate": torch.randn(8, 16, generator=gen), "up": torch.randn(8, 16, generator=gen),
                       "down": torch.randn(16, 8, generator=gen)}
    export_experts(((0, e, weights()) for e in range(2)), tmp_path, model="random", num_layers=1, num_experts=2,
                   act="silu")
    runtime = ExpertHostRuntime(WeightStore.open(tmp_path), device="cpu", capacity_bytes=10**6, keep_alive_s=60)
    try:
        runtime.invoke(0, {0: torch.randn(3, 16), 1: torch.randn(5, 16)})
        meters = parse_host_metrics(generate_latest(registry_for(runtime)).decode())
        status = runtime.status()
    finally:
        runtime.close()
    assert meters.cold_starts == status["meters"]["cold_starts"] == 2 and meters.tokens == 8
    assert meters.gb_seconds > 0 and meters.bytes_held == status["meters"]["bytes_held"] > 0
    assert sorted((r.layer, r.expert, r.tokens) for r in meters.replicas) == [(0, 0, 3), (0, 1, 5)]


def test_operator_usage_errors_are_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moeless", "operator", "--kubeconfig", str(tmp_path / "none")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--kubeconfig" in result.stderr
    help_text = subprocess.run([sys.executable, "-m", "moeless", "operator", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert "ExpertAutoscalingPolicy" in help_text and "--resync-s" in help_text


def test_one_owner_s_unexpected_error_is_logged_and_the_others_are_still_reconciled(caplog):
    """A bug or a reply the client cannot parse, for one policy, fails that policy's pass only."""
    policy = lambda name: {"apiVersion": "moeless.io/v1alpha1", "kind": "ExpertAutoscalingPolicy",
                           "metadata": {"name": name, "namespace": "ml", "generation": 1}, "spec": {}}

    class Kube:
        applied: list[str] = []
        list_policies = staticmethod(lambda namespace: [policy("a"), policy("b")])
        list_pools = staticmethod(lambda namespace: [])
        managed_pools = staticmethod(lambda namespace, kind: set())
        observe_pool = None

        def observe(self, namespace, name, owner, policies, pool_hosts):
            if name == "a":
                raise ValueError("a reply the client could not parse")
            return Observed()

        def apply(self, namespace, owner, actions, now):
            self.applied.append(owner["metadata"]["name"])
            return []

    kube = Kube()
    assert Operator(kube, "ml", clock=lambda: T0).pass_once() == 1
    assert kube.applied == ["b"]
    assert "ml/a: unexpected error" in caplog.text and "could not parse" in caplog.text


def test_a_watch_that_keeps_failing_the_same_way_is_logged_once(caplog):
    """While the ExpertPool CRD is missing the watch fails every second: one line, not one a second."""
    def missing(*args, **kwargs):
        raise ApiException(status=404, reason="Not Found")

    kube = type("Kube", (), {"custom": type("Custom", (), {"list_namespaced_custom_object": staticmethod(missing)})()})()
    stop = threading.Event()
    watcher = threading.Thread(target=Operator(kube, "ml")._watch, args=(stop, "expertpools"))
    with caplog.at_level(logging.INFO, logger="moeless.operator"):
        watcher.start()
        stop.wait(2.5)  # three tries, a second apart
        stop.set()
        watcher.join(5)
    lines = [r.getMessage() for r in caplog.records if "watch ended" in r.getMessage()]
    assert lines == ["expertpools watch ended: Not Found (retried every second)"]
