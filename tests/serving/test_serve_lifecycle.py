"""`moeless serve` as a user runs it (a real process with Ray, Serve and expert-host processes):
a SIGKILLed host is restarted and re-joins (/healthz degraded meanwhile); SIGINT and SIGTERM stop
it cleanly: running requests finish or are told why not, exit status 0, no process left."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

MODEL = "tiny-mixtral"


class Served:
    """A `moeless serve` process; every process it starts carries `mark` in its environment."""

    def __init__(self, tmp_path, drain_s: float):
        self.mark = uuid.uuid4().hex
        env = dict(os.environ, MOELESS_CACHE=str(tmp_path), MOELESS_TEST_MARK=self.mark)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moeless", "serve", "--model", "tiny:mixtral", "--port", "0", "--hosts", "2",
             "--drain-s", str(drain_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output = []
        deadline = time.monotonic() + 240
        for line in self.process.stdout:
            self.output.append(line)
            found = re.search(r"serving \S+ at (http://\S+)", line)
            if found:
                self.url = found.group(1)
                return
            assert time.monotonic() < deadline, "".join(self.output)
        raise AssertionError("moeless serve exited before serving:\n" + "".join(self.output))

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process started by this serve (itself included)."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"MOELESS_TEST_MARK={self.mark}".encode() not in f.read():
                        continue
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(") ", 1)[1][0] == "Z":  # exited, waiting to be reaped
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return found

    def hosts(self) -> list[int]:
        return sorted(pid for pid, cmd in self.processes().items() if "moeless.expert_fn.host" in cmd)

    def stop(self, sig: int) -> str:
        self.process.send_signal(sig)
        rest = self.process.stdout.read()
        self.process.wait(120)
        self.output.append(rest)
        return "".join(self.output)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.processes():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def served(tmp_path, request):
    server = Served(tmp_path, request.param)
    yield server
    server.kill()  # only if a test failed half-way


def _complete(url, prompt, n):
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n}, timeout=60)


def _wait_for(check, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _stream_then_signal(served, sig, max_tokens):
    """Stream a completion; send `sig` to moeless serve after the first chunk; return the events."""
    events = []
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "a long story", "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 1:
                served.process.send_signal(sig)
    return events


def _no_process_left(served):
    _wait_for(lambda: not served.processes(), 30, "every process of moeless serve to exit")


@pytest.mark.parametrize("served", [30.0], indirect=True)
def test_killed_host_restarts_and_rejoins_then_sigint_finishes_the_stream_and_exits_clean(served, reference_text,
                                                                                          tiny_store):
    model, _ = tiny_store  # the same weights as tiny:mixtral
    url = served.url
    assert _complete(url, "warm up", 3).json()["choices"][0]["text"] == reference_text(model, "warm up", 3)
    running = served.processes()
    assert len(served.hosts()) == 2 and any("gcs_server" in cmd or "raylet" in cmd for cmd in running.values())
    # 1. SIGKILL a host: /healthz says degraded, requests still get exact answers, the host comes back.
    victim = served.hosts()[1]
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: httpx.get(f"{url}/healthz").json()["status"] == "degraded", 10, "/healthz to say degraded")
    assert _complete(url, "while down", 4).json()["choices"][0]["text"] == reference_text(model, "while down", 4)
    _wait_for(lambda: httpx.get(f"{url}/healthz").json()["status"] == "ok", 60, "the host to be restarted")
    assert victim not in served.hosts() and len(served.hosts()) == 2
    # 2. It re-joins: the serving path stops counting it dead once it answers its probe again.
    def rejoined():
        assert _complete(url, "after restart", 3).json()["choices"][0]["text"] == reference_text(model, "after restart", 3)
        return "moeless_dead_expert_hosts 0.0" in httpx.get(f"{url}/metrics").text
    _wait_for(rejoined, 30, "the restarted host to re-join")
    # 3. SIGINT mid-stream: the stream finishes (drain 30 s), the process exits 0, nothing is left.
    events = _stream_then_signal(served, signal.SIGINT, 60)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == reference_text(model, "a long story", 60)
    output = served.stop(signal.SIGINT)  # a second SIGINT while draining changes nothing
    assert served.process.returncode == 0, output
    assert "Traceback" not in output and "0 requests ended unfinished" in output
    _no_process_left(served)


@pytest.mark.parametrize("served", [0.0], indirect=True)
def test_sigterm_mid_stream_tells_the_client_and_leaves_no_process(served):
    events = _stream_then_signal(served, signal.SIGTERM, 240)  # drain 0 s: the stream cannot finish
    error = json.loads(events[-2])
    assert events[-1] == "[DONE]" and error["error"]["code"] == "shutting_down", events[-3:]
    assert "shut down before this request finished" in error["error"]["message"]
    served.process.wait(120)
    output = served.stop(signal.SIGTERM)  # already exited: just collects its output
    assert served.process.returncode == 0, output
    assert "Traceback" not in output and "1 requests ended unfinished" in output
    _no_process_left(served)
