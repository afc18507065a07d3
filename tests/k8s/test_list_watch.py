"""ListWatch (controller/pool/list_watch.py) against a real API server: one list, then every change
by the watch; a Role that may list but not watch makes it list every period instead."""

from __future__ import annotations

import pytest
from kubernetes import client, config

from moeless.controller.pool.list_watch import ListWatch, ListWatchError

from k8s_support import account_with_role, service_account_kubeconfig, wait_for

pytestmark = pytest.mark.k8s
NS, SELECTOR = "watched", "app.kubernetes.io/component=expert-host"


@pytest.fixture(scope="module")
def core(cluster, kubectl):
    kubectl("create", "namespace", NS)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))


def make_pod(core, name: str, component: str = "expert-host") -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
           "spec": {"containers": [{"name": "c", "image": "moeless:test"}]}}

    def create() -> bool:
        try:
            return bool(core.create_namespaced_pod(NS, pod))
        except client.ApiException as err:  # the namespace's default service account has no token yet
            if err.status not in (403, 500):
                raise
            return False

    wait_for(create, what=f"pod {name} created")


def names(watch: ListWatch) -> set[str]:
    return {o["metadata"]["name"] for o in watch.objects()}


def test_one_list_then_every_change_through_the_watch(core):
    watch = ListWatch(core.list_namespaced_pod, NS, label_selector=SELECTOR, period_s=0.2, what="pods")
    try:
        assert watch.objects() == [] and watch.lists == 1
        make_pod(core, "a-0")
        make_pod(core, "other-0", component="operator")  # not selected: never in the cache
        wait_for(lambda: names(watch) == {"a-0"}, timeout=10, what="the new pod through the watch")
        core.patch_namespaced_pod_status("a-0", NS, {"status": {"podIP": "10.0.0.7"}})
        wait_for(lambda: watch.objects()[0]["status"].get("podIP") == "10.0.0.7", timeout=10, what="its new address")
        core.delete_namespaced_pod("a-0", NS, grace_period_seconds=0)
        wait_for(lambda: names(watch) == set(), timeout=10, what="the pod gone")
        assert watch.watching and watch.lists == 1  # no request per read, no list after the first
    finally:
        watch.close()
        for pod in core.list_namespaced_pod(NS).items:
            core.delete_namespaced_pod(pod.metadata.name, NS, grace_period_seconds=0)


def test_a_role_without_watch_lists_every_period_and_one_without_list_says_so(cluster, core, tmp_path):
    account_with_role(core, NS, "lister", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    lister = client.CoreV1Api(config.new_client_from_config(
        config_file=str(service_account_kubeconfig(cluster, NS, "lister", tmp_path / "lister"))))
    watch = ListWatch(lister.list_namespaced_pod, NS, label_selector=SELECTOR, period_s=0.2, what="pods")
    try:
        assert watch.objects() == []
        make_pod(core, "b-0")
        wait_for(lambda: names(watch) == {"b-0"}, timeout=10, what="the new pod by listing")
        assert not watch.watching and watch.lists > 1
    finally:
        watch.close()
        core.delete_namespaced_pod("b-0", NS, grace_period_seconds=0)
    account_with_role(core, NS, "nobody", [])
    nobody = client.CoreV1Api(config.new_client_from_config(
        config_file=str(service_account_kubeconfig(cluster, NS, "nobody", tmp_path / "nobody"))))
    refused = ListWatch(nobody.list_namespaced_pod, NS, label_selector=SELECTOR, what="pods")
    try:
        with pytest.raises(ListWatchError, match="cannot list pods: 403 Forbidden"):
            refused.objects()
    finally:
        refused.close()
