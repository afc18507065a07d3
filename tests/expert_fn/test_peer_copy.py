"""A replica copied from a peer host that holds it (expert_fn/host/peer_copy.py): two real hosts over
gRPC, whose layer numbers differ (one serves a base and its fine-tune, the other the fine-tune
alone), asked by content key; the copy computes exactly what a load from the store does; a peer
that is gone or does not hold the replica, and a host tier that holds it, read no peer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.host.metrics import registry_for
from moeless.expert_fn.host.peer_batches import COPY_BATCH_BYTES
from moeless.expert_fn.host.peer_copy import PROBE_EVERY, PeerCopies, _averaged
from moeless.expert_fn.host import peer_links
from moeless.expert_fn.host.peer_holder import MAX_CAPACITY, NO_LINK, HolderLinks
from moeless.expert_fn.wire.replica_weights import PeerCopyError, put_weights, weights_from
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.expert_fn.host.servicer import ExpertHostServicer
from moeless.expert_fn.stores.model_stores import ModelStores
from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.wire import nixl_link
from moeless.expert_fn.wire.codec import CHANNEL_OPTIONS
from moeless.model.finetune import perturbed
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import export_store
from tests.serving.host_waits import wait_until

CODE_OWN = [(0, 1), (1, 3)]  # the fine-tune's own experts; the rest are its base's bytes


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELESS_CACHE", str(tmp_path_factory.mktemp("cache")))
        base = tiny_model("mixtral", 0)
        base_root = export_store(base, "base")
        code_root = export_store(perturbed(base, CODE_OWN, 0.01, 1), "code", base=base_root)
        yield {"base": base_root, "code": code_root, "layers": base.spec.num_layers, "hidden": base.spec.hidden_size,
               "experts": base.spec.num_experts,
               "expert_bytes": 3 * base.spec.expert_ffn * base.spec.hidden_size * 4}


def _host(roots, peer_copies="measured"):
    """A runtime over `roots` ((name, dir) pairs) behind a real gRPC server: (runtime, server, address)."""
    runtime = ExpertHostRuntime(ModelStores.open(roots), capacity_bytes=1 << 30, keep_alive_s=60.0,
                                peer_copies=peer_copies)
    runtime.health = "serving"
    server = grpc.server(ThreadPoolExecutor(4), options=CHANNEL_OPTIONS)
    pb_grpc.add_ExpertHostServicer_to_server(ExpertHostServicer(runtime, models=runtime.models.ranges()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return runtime, server, f"127.0.0.1:{port}"


@pytest.fixture
def hosts(stores):
    """Host a serves the base and the fine-tune (code's layer l is a's layer L + l); host b the fine-tune alone,
    copying from a peer whenever given one (`--peer-copies always`: the measured choice is tested on its own)."""
    a = _host([("base", stores["base"]), ("code", stores["code"])])
    b = _host([("code", stores["code"])], "always")
    yield a, b
    for runtime, server, _ in (a, b):
        server.stop(None)
        runtime.close()


def _out(runtime, layer, expert, x):
    return runtime.invoke(layer, {expert: x}).outputs[expert]


def test_a_load_copies_from_the_peer_by_content_key_and_computes_what_a_store_load_does(hosts, stores):
    (a, _, address_a), (b, _, _) = hosts
    L = stores["layers"]
    a.load(0, 0, wait=True)  # the base's (0, 0), which the fine-tune shares
    a.load(L + 0, 1, wait=True)  # the fine-tune's own (0, 1), at a's numbering
    b.load(0, 0, wait=True, source=address_a)  # as bytes over gRPC while b opens a NIXL link to a
    wait_until(lambda: b.peers.linked() == [address_a], "b's NIXL link to a")
    b.load(0, 1, wait=True, source=address_a)  # WRITTEN over that link (peer_links.py)
    assert b.peers.figures()["copies"] == 2 and b.peers.figures()["fallbacks"] == 0
    assert b.peers.figures()["linked"] == 1
    assert b.tier.stats()["misses"] == 0  # no file read, no checksum
    assert a.peers.figures()["served"] == 2
    assert b.peers.figures()["bytes"] == 2 * stores["expert_bytes"]
    x = torch.randn(5, stores["hidden"], generator=torch.Generator().manual_seed(0))
    assert torch.equal(_out(b, 0, 0, x), _out(a, 0, 0, x))
    assert torch.equal(_out(b, 0, 1, x), _out(a, L + 0, 1, x))
    assert not torch.equal(_out(b, 0, 1, x), _out(a, 0, 1, x))  # the base's (0, 1) differs: not what was copied
    # The copies entered b's host tier: evicted and loaded again, each is a hit, not another copy.
    assert b.tier.stats()["offered"] == 2 and b.evict(0, 1)[0]
    b.load(0, 1, wait=True, source=address_a)
    assert b.peers.figures()["copies"] == 2 and b.tier.stats()["hits"] == 1 and b.tier.stats()["misses"] == 0
    assert torch.equal(_out(b, 0, 1, x), _out(a, L + 0, 1, x))
    assert "moeless_expert_host_tier_offered_total 2.0" in generate_latest(registry_for(b)).decode()


def test_a_load_many_s_replicas_from_one_peer_come_in_one_ask_over_its_link_and_compute_exactly(hosts, stores):
    (a, _, address_a), (b, _, address_b) = hosts
    L, E = stores["layers"], stores["experts"]
    for layer in range(L):
        for expert in range(E):
            a.load(L + layer, expert, wait=True)  # the fine-tune's every expert (its base's where shared)
    b.load(0, 0, wait=True, source=address_a)  # as bytes over gRPC while b opens its link to a
    wait_until(lambda: b.peers.linked() == [address_a], "b's NIXL link to a")
    rest = [(layer, expert) for layer in range(L) for expert in range(E)][1:]
    with ExpertHostClient(address_b) as client:  # through the servicer: the LoadMany's copies expected by peer
        client.load_many(rest, wait=True, sources=[address_a] * len(rest))
    copies = b.peers.figures()
    assert copies["copies"] == 1 + len(rest) and copies["fallbacks"] == 0 and copies["linked"] == len(rest)
    assert copies["batched"] == len(rest) - 1  # one ask brought them all (the region holds 64 MB)
    assert copies["link_bytes"] == a.peers.figures()["link_bytes"] == COPY_BATCH_BYTES  # one region at each end
    assert a.peers.figures()["served"] == 1 + len(rest) and b.tier.stats()["misses"] == 0
    kept = [{t.untyped_storage().data_ptr() for t in b.tier._entries[key].values()} for key in b.tier._entries]
    assert len(kept) == 1 + len(rest) and len(set().union(*kept)) == sum(map(len, kept))  # each its own memory
    # (the host tier keeps a copy's tensors as they came: views of one batch's buffer would hold it all)
    x = torch.randn(5, stores["hidden"], generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(_out(b, layer, expert, x), _out(a, L + layer, expert, x)) for layer, expert in rest)
    registry = registry_for(b)
    assert "moeless_expert_host_peer_copy_batched_total" in generate_latest(registry).decode()
    assert registry.get_sample_value("moeless_expert_host_peer_link_bytes") == COPY_BATCH_BYTES


@pytest.mark.parametrize("ask_mb", [None, 0])  # the default (1 GiB), or one region's worth an ask (--peer-ask-mb 0)
def test_a_load_many_larger_than_the_link_s_region_streams_through_it_in_one_ask(ask_mb, hosts, stores, monkeypatch):
    (a, _, address_a), (b, _, address_b) = hosts
    if ask_mb is not None:
        b.peers.ask_bytes = ask_mb << 20
    L, E = stores["layers"], stores["experts"]
    monkeypatch.setattr(peer_links, "COPY_BATCH_BYTES", 2 * stores["expert_bytes"])  # a region of two replicas
    for layer in range(L):
        for expert in range(E):
            a.load(L + layer, expert, wait=True)
    b.load(0, 0, wait=True, source=address_a)  # as bytes over gRPC while b opens its link to a
    wait_until(lambda: b.peers.linked() == [address_a], "b's NIXL link to a")
    rest = [(layer, expert) for layer in range(L) for expert in range(E)][1:]
    with ExpertHostClient(address_b) as client:
        client.load_many(rest, wait=True, sources=[address_a] * len(rest))
    copies, served, asks = b.peers.figures(), a.peers.figures(), 1 if ask_mb is None else -(-len(rest) // 2)
    assert copies["linked"] == len(rest) and copies["batched"] == len(rest) - asks and copies["fallbacks"] == 0
    assert served["writes"] == -(-len(rest) // 2) > 1 and copies["link_bytes"] == 2 * stores["expert_bytes"]
    assert served["served"] == 1 + len(rest) and b.tier.stats()["misses"] == 0
    x = torch.randn(5, stores["hidden"], generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(_out(b, layer, expert, x), _out(a, L + layer, expert, x)) for layer, expert in rest)
    assert registry_for(a).get_sample_value("moeless_expert_host_peer_copy_writes_total") == served["writes"]


def test_a_holder_closes_an_idle_link_and_the_asker_opens_another_not_falling_back_to_bytes(hosts, stores):
    (a, _, address_a), (b, _, _) = hosts
    x = torch.randn(3, stores["hidden"], generator=torch.Generator().manual_seed(3))
    shared = [(0, 0), (0, 2), (0, 3), (1, 0)]  # the fine-tune's experts that are its base's, the same keys on a
    for layer, expert in shared:
        a.load(layer, expert, wait=True)
    b.load(*shared[0], wait=True, source=address_a)  # as bytes while b opens its link to a
    wait_until(lambda: b.peers.linked() == [address_a], "b's NIXL link to a")
    a.peers.holder.idle_s = 0.2
    time.sleep(0.3)
    assert a.peers.figures()["link_bytes"] == 0  # closed idle: its region given back (at the status read)
    b.load(*shared[1], wait=True, source=address_a)  # over the link a closed: answered as bytes, marked unlinked
    assert b.peers.figures()["linked"] == 0 and b.peers.linked() == [] and b.peers.links.usable(address_a)
    a.peers.holder.idle_s = 600.0
    b.load(*shared[2], wait=True, source=address_a)  # as bytes while b opens a new link (not bytes from now on)
    wait_until(lambda: b.peers.linked() == [address_a], "b's new NIXL link to a")
    b.load(*shared[3], wait=True, source=address_a)
    copies = b.peers.figures()
    assert copies["copies"] == 4 and copies["linked"] == 1 and copies["fallbacks"] == 0
    assert all(torch.equal(_out(b, layer, e, x), _out(a, layer, e, x)) for layer, e in shared)


def test_a_failed_write_answers_as_bytes_and_the_asker_copies_as_bytes_from_then_on_not_reopening(hosts, stores):
    (a, _, address_a), (b, _, _) = hosts
    x = torch.randn(3, stores["hidden"], generator=torch.Generator().manual_seed(4))
    shared = [(0, 0), (0, 2), (0, 3)]
    for layer, expert in shared:
        a.load(layer, expert, wait=True)
    b.load(*shared[0], wait=True, source=address_a)  # as bytes while b opens its link to a
    wait_until(lambda: b.peers.linked() == [address_a], "b's NIXL link to a")
    [(held, _)] = a.peers.holder._links.values()

    def broken(*_):
        raise nixl_link.NixlError("a UCX error")
    held.post_write = broken
    b.load(*shared[1], wait=True, source=address_a)  # a's WRITE fails: answered as bytes, not marked unlinked
    assert not b.peers.links.usable(address_a) and b.peers.linked() == [] and a.peers.figures()["link_bytes"] == 0
    b.load(*shared[2], wait=True, source=address_a)  # as bytes: no new link
    time.sleep(0.2)
    copies = b.peers.figures()
    assert copies["copies"] == 3 and copies["linked"] == 0 and b.peers.linked() == []
    assert all(torch.equal(_out(b, layer, e, x), _out(a, layer, e, x)) for layer, e in shared)


def test_a_holder_without_nixl_refuses_the_link_in_one_line_and_its_replicas_come_as_bytes(stores, caplog):
    holder = _host([("code", stores["code"])], PeerCopies(nixl=False))
    asker = _host([("code", stores["code"])], "always")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.ExpertHostStub(grpc.insecure_channel(holder[2])).OpenCopyLink(pb.CopyLinkOffer(offer=b"x", capacity=64))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "bytes only: NIXL is turned off on this expert host (expert-host --no-nixl)" in refused.value.details()
        holder[0].load(0, 0, wait=True)
        holder[0].load(0, 1, wait=True)
        asker[0].load(0, 0, wait=True, source=holder[2])
        wait_until(lambda: "copying its replicas as bytes over gRPC from now on" in caplog.text, "the link refused")
        asker[0].load(0, 1, wait=True, source=holder[2])
        assert asker[0].peers.figures()["copies"] == 2 and asker[0].peers.figures()["linked"] == 0
        assert asker[0].peers.linked() == [] and asker[0].tier.stats()["misses"] == 0
        x = torch.randn(3, stores["hidden"], generator=torch.Generator().manual_seed(1))
        assert all(torch.equal(_out(asker[0], 0, e, x), _out(holder[0], 0, e, x)) for e in (0, 1))
    finally:
        for runtime, server, _ in (holder, asker):
            server.stop(None)
            runtime.close()


def test_warming_nixl_keeps_one_agent_and_links_open_after_it():
    assert nixl_link.warm() is None and nixl_link.warm() is None and len(nixl_link._WARM) == 1  # once a process
    ends = nixl_link.NixlLink("a", 64, "cpu", regions=1), nixl_link.NixlLink("b", 64, "cpu", regions=1)
    ends[0].connect(ends[1].offer())
    ends[1].connect(ends[0].offer())
    ends[0].region(0, 3).copy_(torch.tensor([1, 2, 3], dtype=torch.uint8))
    ends[0].post_write(0, 3, b"n")
    with ThreadPoolExecutor(1) as pool:  # a WRITE completes only while both ends drive their workers
        sent = pool.submit(ends[0].finish_write, 10.0)
        ends[1].wait_note(b"n", 10.0)
        sent.result()
    assert ends[1].region(0, 3).tolist() == [1, 2, 3]
    for end in ends:
        end.close()


def test_a_copy_link_of_no_bytes_or_past_the_bound_is_refused_by_name():
    links = HolderLinks("cpu")
    for capacity in (0, MAX_CAPACITY + 1):
        with pytest.raises(ValueError, match=rf"a copy link's region must be 1 byte to {MAX_CAPACITY} bytes, asked"):
            links.open(b"offer", capacity)
    assert links.write("nobody", "copy-0", [({"gate": torch.zeros(2)}, pb.ReplicaWeights())]) == NO_LINK  # bytes


def test_a_peer_gone_or_not_holding_it_and_a_tier_that_holds_it_read_no_peer(hosts, stores):
    (a, _, address_a), (b, _, _) = hosts
    b.load(1, 3, wait=True, source=address_a)  # a does not hold it: b's store
    b.load(1, 2, wait=True, source="127.0.0.1:1")  # nobody there: b's store
    assert b.peers.figures()["copies"] == 0 and b.peers.figures()["fallbacks"] == 2
    b.load(1, 1, wait=True, source="127.0.0.1:1")  # down: not asked again, the store at once
    assert b.peers.figures()["fallbacks"] == 2 and b.peers.figures()["passed"] == 1
    assert b.tier.stats()["misses"] == 3 and b.table.state((1, 2)).value in ("idle", "warm")
    a.load(1, 2, wait=True)
    assert b.evict(1, 2)[0]
    b.load(1, 2, wait=True, source=address_a)  # b's host tier holds it: a copy from its own memory
    assert b.peers.figures()["copies"] == 0 and b.tier.stats()["hits"] == 1 and b.peers.figures()["passed"] == 1
    metrics = generate_latest(registry_for(b)).decode()
    assert "moeless_expert_host_peer_copy_fallbacks_total 2.0" in metrics and "moeless_expert_host_peer_copy_copies_total 0.0" in metrics


def test_load_many_takes_a_source_per_replica_over_grpc_and_refuses_a_count_that_differs(hosts, stores):
    (a, _, address_a), (b, _, address_b) = hosts
    a.load(0, 2, wait=True)
    client = ExpertHostClient(address_b, model="code")
    try:
        assert client.load_many([(0, 2), (0, 3)], wait=True, sources=[address_a, ""]) == 2
        status = client.status()
        assert status["peer_copies"]["copies"] == 1 and status["peer_copies"]["seconds"] > 0
        with pytest.raises(BadRequest, match="2 sources for 1 replicas"):
            client.load_many([(1, 0)], sources=[address_a, ""])
    finally:
        client.close()


def test_a_reply_that_is_not_the_key_s_expert_is_refused_naming_what_is_wrong():
    gate, up, down = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    key = "float32-8x16-" + "0" * 64
    reply = pb.ReplicaWeights()
    put_weights(reply, {"gate": gate, "up": up, "down": down})
    back = weights_from(reply, key)
    assert all(torch.equal(back[n], t) for n, t in (("gate", gate), ("up", up), ("down", down)))
    half = pb.ReplicaWeights()
    put_weights(half, {"gate": gate.bfloat16(), "up": up.bfloat16(), "down": down.bfloat16()})
    assert torch.equal(weights_from(half, "bfloat16-8x16-" + "0" * 64)["gate"], gate.bfloat16())
    with pytest.raises(PeerCopyError, match=r"tensor gate is bfloat16 \[8, 16\], where the key says float32"):
        weights_from(half, key)
    with pytest.raises(PeerCopyError, match=r"tensor gate is float32 \[8, 16\], where the key says float32 \[4, 16\]"):
        weights_from(reply, "float32-4x16-" + "0" * 64)
    short = pb.ReplicaWeights()
    put_weights(short, {"gate": gate, "up": up})
    with pytest.raises(PeerCopyError, match=r"tensors \['gate', 'up'\], where an expert has"):
        weights_from(short, key)
    reply.data = reply.data[:-4]
    with pytest.raises(PeerCopyError, match=r"1532 bytes of tensors, where \['gate', 'up', 'down'\] take 1536"):
        weights_from(reply, key)


def test_a_host_copies_from_peers_while_they_measure_faster_and_measures_the_slower_way_now_and_then():
    peers, at = PeerCopies(), "10.0.0.7:50051"
    assert [peers._peer_first(at) for _ in range(2)] == [True] * 2  # nothing measured yet: the peer first
    peers.stats.peer_gb_per_s = 0.1
    assert not peers._peer_first(at)  # the store not measured yet: its turn
    peers.stats.store_gb_per_s = 0.25  # the store faster (this machine's)
    choices = [peers._peer_first(at) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, peer in enumerate(choices) if peer] == [PROBE_EVERY - 4, 2 * PROBE_EVERY - 4]  # the 16th, 32nd offers
    assert peers.stats.passed == 1 + 2 * PROBE_EVERY - 2
    peers.stats.peer_gb_per_s = 2.5  # a GPU link: the peer faster
    choices = [peers._peer_first(at) for _ in range(PROBE_EVERY)]
    assert [i for i, peer in enumerate(choices) if not peer] == [PROBE_EVERY - 4]  # the store measured again once
    assert PeerCopies("always")._peer_first(at) and not PeerCopies("off")._peer_first(at)
    key, nobody = "float32-8x16-" + "0" * 64, "127.0.0.1:1"
    assert not PeerCopies()._peer_first(nobody, key)  # its NIXL link opens first (in the background): the store meanwhile
    assert PeerCopies(nixl=False)._peer_first(nobody, key)  # no NIXL: nothing to wait for
    gpu, no_ipc = PeerCopies(device="cuda:0"), PeerCopies(device="cuda:0", cuda_ipc=False)  # --no-peer-ipc
    assert gpu._ipc_to(at) and not no_ipc._ipc_to(at) and not PeerCopies()._ipc_to(at)
    assert _averaged(0.0, 10**9, 2.0) == 0.5 and _averaged(0.5, 10**9, 1.0) == 0.625  # the first as it is, then 1/4


def test_a_copy_that_fails_in_any_way_loses_no_load(hosts, monkeypatch):
    (a, _, address_a), (b, _, _) = hosts
    a.load(0, 2, wait=True)

    def broken(address, content_key):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(b.peers, "_copy", broken)
    b.load(0, 2, wait=True, source=address_a)  # the store's, after a warning
    assert b.table.state((0, 2)).value in ("idle", "warm") and b.peers.figures()["fallbacks"] == 1
    assert b.tier.stats()["misses"] == 1
