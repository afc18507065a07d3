"""Start expert hosts as local processes on loopback (tests, benchmarks, the embedded default).

    with launch_local_hosts(2, store_dir, keep_alive_s=30) as group:
        clients = [ExpertHostClient(a) for a in group.addresses]
        group.kill(1)      # SIGKILL: a crashed host (its clients get ExpertHostUnavailable)
        group.restart(1)   # a fresh process on the same address, cold
    # leaving the block sends SIGTERM: hosts drain and exit 0

Each host is `python -m moeless.expert_fn.host` on a free port; the group waits for its ready
line. Host logs go to a file per host (`group.log_paths`), shown when a host fails to start.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


class HostStartError(RuntimeError):
    """An expert host process exited or stayed silent before it was ready."""


@dataclass
class _Host:
    process: subprocess.Popen
    port: int
    metrics_port: int | None


class LocalHostGroup:
    """Expert host processes started by launch_local_hosts (index i = the i-th host)."""

    def __init__(self, host_args: list[str], count: int, startup_timeout_s: float) -> None:
        self._host_args = host_args
        self._startup_timeout_s = startup_timeout_s
        self._logs = tempfile.TemporaryDirectory(prefix="moeless-expert-hosts-")
        self.log_paths = [Path(self._logs.name, f"host{i}.log") for i in range(count)]
        self._hosts: list[_Host | None] = [None] * count
        starting: list[subprocess.Popen] = []
        try:
            for i in range(count):  # all start at once, then each is awaited
                starting.append(self._spawn(i, port=0))
            for i, process in enumerate(starting):
                self._hosts[i] = self._await_ready(i, process)
        except BaseException:
            for process in starting[len([h for h in self._hosts if h]):]:
                _reap(process)
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        """gRPC "127.0.0.1:port" of each host."""
        return [f"127.0.0.1:{self._host(i).port}" for i in range(len(self._hosts))]

    @property
    def metrics_urls(self) -> list[str]:
        """http://127.0.0.1:port of each host's /metrics, /healthz, /readyz."""
        if any(self._host(i).metrics_port is None for i in range(len(self._hosts))):
            raise ValueError("these hosts serve no HTTP endpoints: launch them with metrics=True")
        return [f"http://127.0.0.1:{self._host(i).metrics_port}" for i in range(len(self._hosts))]

    def __len__(self) -> int:
        return len(self._hosts)

    def pid(self, i: int) -> int:
        return self._host(i).process.pid

    def alive(self, i: int) -> bool:
        """Whether host i's process is still running."""
        return self._host(i).process.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL host i (no drain) and reap it: a crash, for fault tests."""
        _reap(self._host(i).process)

    def terminate(self, i: int, timeout_s: float = 60.0) -> int:
        """SIGTERM host i, wait for its graceful drain, return its exit status."""
        process = self._host(i).process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _reap(process)
            raise HostStartError(f"expert host {i} did not exit within {timeout_s} s of SIGTERM; killed it") from None

    def restart(self, i: int) -> None:
        """Stop host i if it still runs, then start a fresh (cold) one on the same port."""
        old = self._host(i)
        if old.process.poll() is None:
            self.terminate(i)
        old.process.stdout.close()
        self._hosts[i] = self._await_ready(i, self._spawn(i, port=old.port))

    def close(self) -> None:
        """SIGTERM every host still running and wait for them (SIGKILL after a minute)."""
        for host in self._hosts:
            if host and host.process.poll() is None:
                host.process.send_signal(signal.SIGTERM)
        for host in self._hosts:
            if host:
                try:
                    host.process.wait(60)
                except subprocess.TimeoutExpired:
                    _reap(host.process)
                host.process.stdout.close()
        self._logs.cleanup()

    def __enter__(self) -> "LocalHostGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _host(self, i: int) -> _Host:
        if not 0 <= i < len(self._hosts) or self._hosts[i] is None:
            raise IndexError(f"no expert host {i}; the group has {len(self._hosts)}")
        return self._hosts[i]

    def _spawn(self, i: int, port: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "moeless.expert_fn.host", "--port", str(port), *self._host_args]
        with open(self.log_paths[i], "ab") as log:
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)

    def _await_ready(self, i: int, process: subprocess.Popen) -> _Host:
        """Read process's ready line: {"event": "ready", "port", "metrics_port"}."""
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = process.stdout.readline() if readable else b""
            if line.startswith(b"{"):
                ready = json.loads(line)
                return _Host(process, int(ready["port"]), ready.get("metrics_port"))
            if readable and not line:  # EOF: the process is gone
                break
        _reap(process)
        tail = self.log_paths[i].read_text(errors="replace")[-2000:]
        raise HostStartError(f"expert host {i} did not become ready (exit status {process.returncode}); log tail:\n{tail}")


def _reap(process: subprocess.Popen) -> None:
    """SIGKILL process (if still running), wait for it, close our end of its stdout."""
    process.kill()
    process.wait()
    process.stdout.close()


def launch_local_hosts(
    num_hosts: int,
    store_dir: str | Path | Sequence[tuple[str, str | Path]],
    *,
    keep_alive_s: float = 60.0,
    memory_bytes: int | None = None,
    metrics: bool = True,
    threads: int = 1,
    drain_s: float = 30.0,
    startup_timeout_s: float = 60.0,
    local_channel: bool = True,
    poll_s: float | None = None,
    shares: dict[str, float] | None = None,
    compute_dtype: str = "float32",
    peer_copies: str = "measured",
    nixl: bool = True,
    cpu: bool = False,
    peer_ipc: bool = True,
    peer_ask_mb: float | None = None,
) -> LocalHostGroup:
    """Start num_hosts expert hosts serving store_dir on loopback and wait until all are ready.
    store_dir: a weight store, or (model name, store) pairs that every host serves from one memory
    (model_stores.py).

    memory_bytes: replica memory per host (default: the host's own, 4 GB on a CPU). metrics:
    also serve /metrics, /healthz, /readyz on a free port each (group.metrics_urls).
    local_channel: offer the shared-memory channel (False: gRPC only, as for a remote host).
    poll_s: the hosts' spin for the next data-plane call (expert-host --poll-us; None: its default).
    shares: GB each model is guaranteed while active on every host (expert-host --share; shares.py).
    compute_dtype: "float32" or "store" (expert-host --compute-dtype; runtime.py).
    peer_copies: when a load given a peer copies from it (expert-host --peer-copies; host/peer_copy.py).
    nixl: take clients' NIXL offers on the TCP channel where nixl is installed (False: --no-nixl).
    cpu: compute on the CPU even where a GPU is visible (--cpu).
    peer_ipc: map a GPU peer's memory for copies over CUDA IPC (False: --no-peer-ipc).
    peer_ask_mb: the most MiB one ask of a peer carries (--peer-ask-mb; None: the host's default).
    Hosts exit by themselves when this process dies without closing the group.
    """
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    stores = [(None, store_dir)] if isinstance(store_dir, (str, Path)) else list(store_dir)
    for _, root in stores:
        if not Path(root, "index.json").is_file():
            raise FileNotFoundError(f"{root}: no weight store (index.json); export one with `moeless model export`")
    args = [*(a for name, root in stores for a in ("--store", f"{name}={root}" if name else str(root))), "--keep-alive-s", str(keep_alive_s), "--threads", str(threads), "--drain-s", str(drain_s),
            "--exit-with-parent", "--compute-dtype", compute_dtype, "--peer-copies", peer_copies]
    if memory_bytes is not None:
        args += ["--memory-gb", repr(memory_bytes / 1e9)]
    if metrics:
        args += ["--metrics-port", "0"]
    if not local_channel:
        args += ["--no-local-channel"]
    if poll_s is not None:
        args += ["--poll-us", repr(poll_s * 1e6)]
    if not nixl:
        args += ["--no-nixl"]
    if cpu:
        args += ["--cpu"]
    if not peer_ipc:
        args += ["--no-peer-ipc"]
    if peer_ask_mb is not None:
        args += ["--peer-ask-mb", repr(peer_ask_mb)]
    for name, gb in (shares or {}).items():
        args += ["--share", f"{name}={gb!r}"]
    return LocalHostGroup(args, num_hosts, startup_timeout_s)
