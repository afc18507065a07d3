"""Busy-polling before a blocking read (expert_fn/wire/polling.py), and hosts and clients that poll
answering exactly as those that block."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.polling import Poller
from moeless.expert_fn.wire.routed import RoutedCall

from expert_fn_support import HIDDEN


def test_a_poller_returns_as_soon_as_data_comes_and_gives_up_after_its_window():
    a, b = socket.socketpair()
    a.settimeout(5.0)  # a socket with a timeout: MSG_DONTWAIT would still wait on it; poll(2) does not
    try:
        poller = Poller(a, 0.02)
        started = time.perf_counter()
        assert poller.wait() is False
        assert 0.02 <= time.perf_counter() - started < 1.0
        threading.Timer(0.005, lambda: b.send(b"x")).start()
        assert Poller(a, 2.0).wait() is True
        assert a.recv(1) == b"x"  # the poll read nothing
        b.close()
        assert poller.wait() is True  # EOF is something to read, too
        assert Poller(a, 0.0).wait() is False
    finally:
        a.close()


def test_hosts_and_clients_that_poll_answer_every_transport_as_blocking_ones_do(store):
    x = torch.randn(5, HIDDEN)
    call = RoutedCall(0, [0, 3], [3, 2], torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2, 0, 2], dtype=torch.int32),
                      torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), torch.rand(5), 5)
    answers = {}
    for poll in (0.0, 0.002):
        with launch_local_hosts(1, store.root, metrics=False, poll_s=poll) as hosts:
            for transport in ("local", "tcp"):
                with ExpertHostClient(hosts.addresses[0], transport=transport, poll_s=poll) as client:
                    answers[poll, transport] = client.submit(call, x).result().z.clone()
                    assert client.path == transport
    first = answers[0.0, "local"]
    assert all(torch.equal(z, first) for z in answers.values())


def test_a_negative_poll_is_refused_by_the_host(store):
    run = subprocess.run([sys.executable, "-m", "moeless.cli", "expert-host", "--store", str(store.root),
                          "--poll-us", "-1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--poll-us" in run.stderr
