"""A serving replica on a device (`moeless serve --device`): the replica's path with its device
taken from the model (scripts/gpu_serving_check.py, here on the CPU; on a GPU machine
scripts/gpu_checks.sh runs it on CUDA), and how a device is asked for and refused."""

import sys
from pathlib import Path

import pytest
import torch

from moeless.controller.knobs import KnobError
from moeless.model.interface import Routing
from moeless.model.tiny import tiny_model
from moeless.serving.config import ServeConfig, config_from_args, replica_gpus_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_serving_check  # noqa: E402  (a script, not a package module)


def test_a_replica_on_its_device_equals_the_model_in_process_over_every_transport(tmp_path, monkeypatch):
    """Real expert-host processes; every layer call bit-identical to in-process, continuous batching's
    tokens equal, logits as the unmodified transformers model's."""
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    result = gpu_serving_check.check("cpu", max_tokens=4)
    assert result["device"] == "cpu"
    assert {"local", "tcp", "grpc"} <= set(result["transports"])
    for transport, r in result["transports"].items():
        assert r["layer_calls"] > 0 and r["mismatched_calls"] == 0, (transport, r)
        assert r["tokens_equal"] and r["live_tokens_equal"] and r["greedy_equal_to_transformers"], (transport, r)
        assert r["live_reports"] == 1 + 3, r  # one report per forward: the prefill, then 3 decode steps
        assert r["max_logit_diff_vs_transformers"] < 1e-3 and r["paths"] == [transport], (transport, r)
        assert set(r["p50_ms"]) == {"prefill", "decode"}, r
    assert result["ok"]


def test_the_model_takes_its_inputs_to_its_device():
    moe = tiny_model("mixtral", 0)
    assert moe.to("cpu") is moe and moe.device == torch.device("cpu")
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(moe.generate(ids, 2), moe.generate(ids.to(moe.device), 2))
    # The gates (and a predictor's routing through them) share the blocks' parameters; a move of hf must
    # move them too: torch's Module._apply keeps each Parameter and swaps its data (a dtype shows it here).
    moe.hf.to(torch.float64)
    assert all(moe.gate(l).weight.dtype == torch.float64 for l in range(moe.spec.num_layers))


def test_routing_on_cpu_is_itself_when_it_is_there():
    routing = Routing(torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]), torch.zeros(1, 4))
    assert routing.on_cpu() is routing


def test_a_replica_asks_ray_for_a_gpu_share_that_lets_every_replica_start():
    assert replica_gpus_for("cpu", 4) == 0.0
    assert replica_gpus_for("cuda", 2, visible=4) == 1.0  # one GPU each
    assert replica_gpus_for("cuda", 4, visible=2) == 0.5  # two replicas per GPU
    assert replica_gpus_for("cuda", 3, visible=2) == 0.5  # not 2/3: Ray would fit one such replica per GPU
    assert replica_gpus_for("cuda", 3, visible=1) == 1 / 3
    with pytest.raises(KnobError, match="no CUDA GPU .* --device cpu"):
        replica_gpus_for("cuda", 1, visible=0)
    with pytest.raises(KnobError, match="device 'tpu'"):
        replica_gpus_for("tpu", 1)


def test_a_serve_config_refuses_a_device_without_its_gpu_share():
    with pytest.raises(ValueError, match="needs replica_gpus > 0"):
        ServeConfig("m", tiny_model, ("a:1",), device="cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        ServeConfig("m", tiny_model, ("a:1",), device="gpu", replica_gpus=1.0)
    assert ServeConfig("m", tiny_model, ("a:1",), device="cuda", replica_gpus=0.5).replica_gpus == 0.5


def test_the_ray_app_args_take_a_device():
    """A RayService's application args (the chart's serving.gpus sets device: cuda)."""
    on_gpu = config_from_args({"hosts": "a:1", "model": "tiny:mixtral", "device": "cuda"})
    assert (on_gpu.device, on_gpu.replica_gpus) == ("cuda", 1.0)
    assert (config_from_args({"hosts": "a:1", "model": "tiny:mixtral"}).device, 0.0) == ("cpu", 0.0)
    with pytest.raises(KnobError, match="device 'gpu'; use one of cpu, cuda"):
        config_from_args({"hosts": "a:1", "device": "gpu"})


def test_serve_on_cuda_without_a_gpu_is_one_line_exit_2(capsys, monkeypatch):
    from moeless.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["serve", "--device", "cuda", "--model", "tiny:mixtral"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moeless serve: device cuda: this machine shows no CUDA GPU") and "--device cpu" in err[0]
