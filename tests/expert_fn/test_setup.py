"""Build and environment facts: the committed gRPC code matches the .proto; device detection."""

from __future__ import annotations

import sys
import types

from moeless.expert_fn.wire import gen_proto
from moeless.expert_fn.host.gpu import DEFAULT_CPU_MEMORY_BYTES, DeviceInfo, detect_device, nvml_gpu


def test_committed_generated_code_matches_the_proto(tmp_path):
    for path in gen_proto.generate(tmp_path):
        committed = gen_proto.HERE / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m moeless.expert_fn.wire.gen_proto`"
        )


def test_configured_memory_wins_and_cpu_falls_back_to_the_default():
    device, capacity = detect_device(memory_bytes=123_000)
    assert capacity == 123_000
    device, capacity = detect_device()
    if nvml_gpu(0) is None:  # no GPU here: the CPU with the configured default
        assert device.torch_device == "cpu" and device.source == "config"
        assert capacity == DEFAULT_CPU_MEMORY_BYTES
    else:
        assert device.source in ("nvml", "config") and 0 < capacity


class FakeNVML(types.ModuleType):
    """The slice of pynvml that nvml_gpu uses: one 80 GB GPU with 60 GB free, or no driver."""

    class NVMLError(Exception):
        pass

    def __init__(self, driver: bool) -> None:
        super().__init__("pynvml")
        self.driver, self.shutdowns = driver, 0

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        if not self.driver:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(total=80 * 10**9, free=60 * 10**9)

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA H100"


def test_nvml_reports_the_gpu_and_its_free_memory(monkeypatch):
    nvml = FakeNVML(driver=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvml_gpu(0) == DeviceInfo("cuda:0", "NVIDIA H100", 80 * 10**9, 60 * 10**9, "nvml")
    assert nvml_gpu(1) is None  # no such GPU
    assert nvml.shutdowns == 2


def test_no_driver_means_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=False))
    assert nvml_gpu(0) is None


def test_a_host_told_cpu_stays_on_the_cpu_where_a_gpu_is_visible(monkeypatch):
    """expert-host --cpu (detect_device(None)): what bench transport --device cpu asks of its host."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(driver=True))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert detect_device(0)[0].torch_device == "cuda:0"
    device, capacity = detect_device(None)
    assert device.torch_device == "cpu" and capacity == DEFAULT_CPU_MEMORY_BYTES
