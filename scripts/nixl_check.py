r"""Round trips between two processes on one machine: NIXL (UCX) against moeless's TCP channel and a
bare socket echo, for a decode-sized call (16 rows x 576 float32 = 36,864 bytes) and a prefill-sized
one (1024 x 576 float32 = 2,359,296 bytes): the request one way, a reply of the same size back, no
compute in between. p50 and p90 of the round trip, in microseconds.

1. NIXL 1.5.1 over UCX, DRAM buffers registered and a transfer handle per direction and size made
   once, progress thread off (on: 12-16 ms a round trip, ../shared/ENVIRONMENT.md): the client
   WRITEs the request into the server's buffer with a notification; on it, the server WRITEs the
   same bytes back from there into the client's buffer with a notification; both spin. With UCX's
   default transports, then with UCX_TLS=tcp in both processes (fresh ones). The default here is
   not shared memory: UCX_PROTO_INFO=y shows the WRITE by CMA (process_vm_writev, one kernel copy)
   and notifications over tcp/lo; posix/sysv are unreachable on this VM (UCX_TLS=posix,cma,self:
   "Destination is unreachable", no agent).
2. moeless's TCP channel (expert_fn/client/tcp_channel.py against tcp_server.py in a subprocess with an
   identity runtime), RoutedCall.packed(0, [0], [rows], arange(rows)), poll_s 0 and 0.001 on both
   sides. A request carries 44 bytes of head and lists and 12 bytes a row beyond the rows; a reply 36.
3. A bare Python socket echo (TCP_NODELAY, length-prefixed, recv_into a preallocated buffer): the floor.
Each checks that its last reply equals its request.

NIXL comes with the `nixl` extra (`pip install 'moeless[nixl]'`: nixl-cu12, ~130 MB with its UCX;
the test extra has it), so from the repository root:
    .venv/bin/python scripts/nixl_check.py [--quick] [--out DIR]
The figures below were measured before it was an extra, in a venv of its own with the `nixl` meta
package (the same 1.5.1 library) and moeless.expert_fn reached through links.

Measured
2026-11-25, this 2-core no-GPU VM, two full runs back to back with nothing else busy (load average
1/5/15 min: 0.50 0.92 1.12 before run 1, 0.58 0.92 1.12 after it; 0.79 0.96 1.13 after run 2), each
    PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/tmp/nixl-path /tmp/nixl-venv/bin/python scripts/nixl_check.py \
        --out /tmp/nixl-final-run1   (run 2: --out /tmp/nixl-final-run2)
round trip p50 / p90 in us (36 KB: 300 after 50 warm-up; 2.4 MB: 100 after 20), run 1 | run 2:
                                     36 KB                     2.4 MB
    NIXL UCX default (cma)      28 / 33  |  28 / 34      548 / 607  |  628 / 688
    NIXL UCX_TLS=tcp            57 / 69  |  60 / 69     1039 / 1251 | 1084 / 1337
    TCP channel poll_s=0       255 / 348 | 270 / 682    3128 / 4273 | 3153 / 4042
    TCP channel poll_s=0.001    98 / 160 |  94 / 160    3216 / 4332 | 3113 / 4172
    socket echo (floor)         11 / 14  |  10 / 11     1315 / 1489 | 1118 / 1536
Every reply matched its request. Minutes before, with a pytest run holding one of the two cores
(load 1.45 -> 1.96), NIXL took 24.0 ms a round trip (2.4 MB by default, both sizes with
UCX_TLS=tcp) in one run and the spinning channel (poll_s=0.001) 2.3 ms at 36 KB in the next: two
spinning processes and a third busy one on 2 cores wait out scheduler slices; the blocking ones
(poll_s=0, the echo) held up.

What it means: on one machine the bare socket is the fastest for 36 KB (10-11 us; NIXL's WRITE by
CMA plus a notification over tcp/lo, driven through its Python binding, takes 28 us) and NIXL is
the fastest for 2.4 MB (550-630 us: one kernel copy straight into the peer's registered buffer,
against 1.1-1.3 ms for the socket's copies through the kernel). NIXL with UCX_TLS=tcp, the path
between pods without RDMA, takes 57-60 us and 1.04-1.08 ms: ~4.5x less than moeless's TCP channel
at 36 KB with poll_s=0 (255-270 us; ~1.6x less than its 94-98 us spinning) and ~3x less at 2.4 MB
(3.1-3.2 ms), but not less than the bare echo over the same loopback (5-6x it at 36 KB, a little
under it at 2.4 MB). So the channel's gap to NIXL is its own per-call Python and torch work on both
sides (framing, the row gather, the host's decode, routed run and reply; not broken down here),
not TCP: that is what to trim first, with no 460 MB dependency. Only NIXL can move GPU memory
without a host copy (GPUDirect RDMA between nodes, NVLink / CUDA IPC within one, through UCX's cuda
transports); the TCP channel's rows go through host memory. That was not measured here (no GPU, no
RDMA NIC).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from moeless.expert_fn.wire.nixl_link import nixl_api, unavailable

H = 576
SIZES = {"36 KB": 16, "2.4 MB": 1024}  # label -> rows of H float32
MAX_BYTES = 4 * H * max(SIZES.values())

def repeats(rows: int, quick: bool) -> tuple[int, int]:
    """(warm-up, measured) round trips for a call of `rows` rows."""
    if rows <= 16:
        return (10, 60) if quick else (50, 300)
    return (5, 30) if quick else (20, 100)

def time_trips(trip: Callable[[], None], warm: int, n: int) -> dict:
    for _ in range(warm):
        trip()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        trip()
        ts.append(time.perf_counter() - t)
    p50, p90 = np.percentile(ts, [50, 90]) * 1e6
    return {"p50_us": round(float(p50), 1), "p90_us": round(float(p90), 1), "n": n}

def spawn(role: str, *args: str) -> tuple[subprocess.Popen, int]:
    """This script in `role`, in a subprocess; it prints "PORT <n>" (NIXL may log to stdout first)."""
    proc = subprocess.Popen([sys.executable, __file__, "--role", role, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("PORT "):
            return proc, int(line.split()[1])
    raise RuntimeError(f"{role} exited with {proc.wait()} before it listened")

def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True

def swap(sock: socket.socket, mine: tuple) -> tuple:
    """Send `mine` to the peer over `sock` and return what it sent (both sides call this)."""
    with sock.makefile("rwb") as f:
        pickle.dump(mine, f)
        f.flush()
        return pickle.load(f)

def accept_one() -> socket.socket:
    """Listen on a free loopback port, tell the parent which, and take one connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    print("PORT", listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn

# --- 3. the bare socket echo -------------------------------------------------------------------

def serve_echo(args: argparse.Namespace) -> None:
    conn = accept_one()
    head, buf = bytearray(4), memoryview(bytearray(MAX_BYTES))
    while recv_exact(conn, memoryview(head)):
        n = int.from_bytes(head, "little")
        recv_exact(conn, buf[:n])
        conn.sendall(buf[:n])

def measure_echo(quick: bool) -> dict[str, dict]:
    proc, port = spawn("echo")
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, reply = {}, memoryview(bytearray(MAX_BYTES))
    try:
        for label, rows in SIZES.items():
            n = 4 * H * rows
            request = n.to_bytes(4, "little") + np.random.bytes(n)

            def trip() -> None:
                sock.sendall(request)
                recv_exact(sock, reply[:n])
            out[label] = time_trips(trip, *repeats(rows, quick))
            out[label]["ok"] = reply[:n] == request[4:]
    finally:
        sock.close()
        proc.wait(10)
    return out

# --- 2. moeless's TCP channel ------------------------------------------------------------------

class Identity:
    """An expert host runtime whose experts return their inputs (on the CPU, in float32)."""
    health, device = "serving", "cpu"

    def __init__(self):
        import torch
        self.dtype = torch.float32

    def invoke(self, layer: int, batches: dict, on_device: bool = False, out=None) -> object:
        if out is not None:  # the outputs as out's consecutive slices, as ExpertHostRuntime.invoke
            import torch
            torch.cat(list(batches.values()), out=out)

        class Result:
            outputs, cold_starts, compute_s = dict(batches), 0, 0.0
        return Result()

def serve_tcp_channel(args: argparse.Namespace) -> None:
    from moeless.expert_fn.host.tcp_server import TcpServer
    server = TcpServer(Identity(), "127.0.0.1", 0, poll_s=args.poll_s)
    print("PORT", server.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.close(5)

def measure_tcp_channel(poll_s: float, quick: bool) -> dict[str, dict]:
    import torch
    from moeless.expert_fn.wire.routed import RoutedCall
    from moeless.expert_fn.client.tcp_channel import TcpChannel
    torch.set_num_threads(1)
    proc, port = spawn("tcp-channel", "--poll-s", str(poll_s))
    channel, out = TcpChannel(f"127.0.0.1:{port}", poll_s=poll_s), {}
    try:
        for label, rows in SIZES.items():
            call, x = RoutedCall.packed(0, [0], [rows], torch.arange(rows)), torch.randn(rows, H)
            out[label] = time_trips(lambda: channel.submit(call, x).result(), *repeats(rows, quick))
            out[label]["ok"] = bool(torch.equal(channel.submit(call, x).result().z, x))
    finally:
        channel.close()
        proc.stdin.close()
        proc.wait(10)
    return out

# --- 1. NIXL over UCX: client and server each in a subprocess, UCX_TLS as the parent chose ------

def nixl_agent_with(name: str, buffers: int) -> tuple[object, list[np.ndarray]]:
    """An agent without the progress thread, and `buffers` DRAM buffers of MAX_BYTES registered."""
    api = nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    bufs = [np.frombuffer(np.random.bytes(MAX_BYTES), np.uint8).copy() for _ in range(buffers)]
    agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    return agent, bufs

def write_handle(agent, local: int, remote: int, peer: str, n: int, notif: bytes):
    return agent.initialize_xfer("WRITE", agent.get_xfer_descs([(local, n, 0)], "DRAM"),
                                 agent.get_xfer_descs([(remote, n, 0)], "DRAM"), peer, notif)

def finish(agent, handle, state: str) -> None:
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended in state {state}")

def serve_nixl(args: argparse.Namespace) -> None:
    agent, (buf,) = nixl_agent_with("server", 1)
    conn = accept_one()  # for the metadata and the buffers' addresses
    meta, client_buf = swap(conn, (agent.get_agent_metadata(), buf.ctypes.data))
    agent.add_remote_agent(meta)
    replies = {4 * H * rows: write_handle(agent, buf.ctypes.data, client_buf, "client", 4 * H * rows, b"rep")
               for rows in SIZES.values()}
    while True:
        for message in [m for ms in agent.get_new_notifs().values() for m in ms]:
            if message == b"stop":
                return
            handle = replies[int(message)]  # the request's size; its bytes are in buf already
            finish(agent, handle, agent.transfer(handle))

def nixl_client(args: argparse.Namespace) -> None:
    proc, port = spawn("nixl-server")  # inherits this process's UCX_TLS
    agent, (send, recv) = nixl_agent_with("client", 2)
    sock = socket.create_connection(("127.0.0.1", port))
    meta, server_buf = swap(sock, (agent.get_agent_metadata(), recv.ctypes.data))
    agent.add_remote_agent(meta)
    out = {}
    for label, rows in SIZES.items():
        n = 4 * H * rows
        handle = write_handle(agent, send.ctypes.data, server_buf, "server", n, str(n).encode())

        def trip() -> None:  # post the request, then spin until it is done and the reply's notification came
            state, replied = agent.transfer(handle), False
            while state == "PROC" or (state == "DONE" and not replied):
                if state == "PROC":
                    state = agent.check_xfer_state(handle)
                if not replied:
                    replied = any(agent.get_new_notifs().values())
            finish(agent, handle, state)
        recv[:n] = 0
        out[label] = time_trips(trip, *repeats(rows, args.quick))
        out[label]["ok"] = bool(np.array_equal(recv[:n], send[:n]))
        agent.release_xfer_handle(handle)
    agent.send_notif("server", b"stop")
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        agent.get_new_notifs()  # progress, so that the stop goes out
    proc.kill()
    print("RESULT " + json.dumps(out), flush=True)

def measure_nixl(tls: str | None, quick: bool) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    env.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout
    if tls:
        env["UCX_TLS"] = tls
    done = subprocess.run([sys.executable, __file__, "--role", "nixl-client", *(["--quick"] if quick else [])],
                          env=env, stdout=subprocess.PIPE, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"NIXL client (UCX_TLS={tls}) failed with {done.returncode}: {done.stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])

# --- the comparison ----------------------------------------------------------------------------

def table(results: dict[str, dict]) -> str:
    head = f"{'method':<30}" + "".join(f"{label + ' p50':>13}{label + ' p90':>13}" for label in SIZES)
    rows = [head, "-" * len(head)]
    for name, by_size in results.items():
        cells = "".join(f"{by_size[label]['p50_us']:>13.0f}{by_size[label]['p90_us']:>13.0f}" for label in SIZES)
        bad = [label for label in SIZES if not by_size[label]["ok"]]
        rows.append(f"{name:<30}{cells}" + (f"  REPLY MISMATCH {bad}" if bad else ""))
    return "\n".join(rows)

def compare(args: argparse.Namespace) -> None:
    why = unavailable()
    if why:
        sys.exit(why)
    load_before = os.getloadavg()
    results = {
        "NIXL UCX default (cma)": measure_nixl(None, args.quick),
        "NIXL UCX_TLS=tcp": measure_nixl("tcp", args.quick),
        "TCP channel poll_s=0": measure_tcp_channel(0.0, args.quick),
        "TCP channel poll_s=0.001": measure_tcp_channel(0.001, args.quick),
        "socket echo (floor)": measure_echo(args.quick),
    }
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "quick": args.quick,
              "cores": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "bytes": {label: 4 * H * rows for label, rows in SIZES.items()}, "results": results}
    print(table(results))
    print("load average before %.2f %.2f %.2f, after %.2f %.2f %.2f" % (*load_before, *report["load_avg_after"]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nixl-check.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out / 'nixl-check.json'}")

ROLES = {"echo": serve_echo, "tcp-channel": serve_tcp_channel, "nixl-server": serve_nixl, "nixl-client": nixl_client}

def main() -> None:
    parser = argparse.ArgumentParser(description="Round trips between two local processes, 36 KB and 2.4 MB each "
                                     "way: NIXL/UCX (default, tcp) vs moeless's TCP channel vs a socket echo.")
    parser.add_argument("--out", type=Path, help="write OUT/nixl-check.json")
    parser.add_argument("--quick", action="store_true", help="fewer round trips (60 and 30 instead of 300 and 100)")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)  # this script's subprocesses
    parser.add_argument("--poll-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ROLES[args.role](args) if args.role else compare(args)

if __name__ == "__main__":
    main()
