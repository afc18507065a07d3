"""The serving options the chart passes on, rendered with the real helm: `moeless serve`'s flags in the
serving Deployment's command and the Ray app's args in the RayService, each read back by what reads
it (the CLI's parser, config_from_args); a bad value refused with the key named."""

from __future__ import annotations

import pytest
import yaml

from test_helm import CHART, helm_run, render

pytestmark = pytest.mark.k8s


def test_serving_micro_batches_reach_the_command_and_the_ray_args_and_a_bad_one_is_refused(helm):
    from moeless.serving.config import config_from_args

    def flags(docs):
        serving = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-moeless-serving")
        command = serving["spec"]["template"]["spec"]["containers"][0]["command"]
        return {flag: command[command.index(flag) + 1] for flag in ("--micro-batches", "--micro-batch-tokens")}

    assert flags(render(helm)) == {"--micro-batches": "1", "--micro-batch-tokens": "256"}  # off by default
    assert flags(render(helm, "serving.microBatches=2", "serving.microBatchTokens=64")) == \
        {"--micro-batches": "2", "--micro-batch-tokens": "64"}
    ray = next(d for d in render(helm, "serving.kuberay=true", "serving.microBatches=2") if d["kind"] == "RayService")
    args = yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (args["micro_batches"], args["micro_batch_tokens"]) == (2, 256)
    served = config_from_args({key: value for key, value in args.items() if key != "config"})  # what the app reads
    assert (served.micro_batches, served.micro_batch_tokens) == (2, 256)
    for value, shown in (("serving.microBatches=0", "serving.microBatches: 0"),
                         ("serving.microBatchTokens=1.5", "serving.microBatchTokens: 1.5")):
        bad = helm_run(helm, "template", "t", str(CHART), "--set", value, check=False)
        assert bad.returncode != 0 and f"{shown} is not a whole number >= 1" in bad.stderr


def test_the_step_scaler_reaches_the_command_and_the_ray_args_and_a_bad_one_is_refused(helm):
    from moeless.cli import build_parser
    from moeless.serving.config import config_from_args

    def command(docs):
        serving = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-moeless-serving")
        return serving["spec"]["template"]["spec"]["containers"][0]["command"]

    assert "--step-slo-ms" not in command(render(helm))  # off by default
    on = command(render(helm, "serving.stepScaler.sloMs=40", "serving.stepScaler.hosts=2",
                        "serving.stepScaler.sloMsByModel.chat=20"))
    parsed = build_parser().parse_args(on[on.index("serve"):])  # what `moeless serve` reads
    assert (parsed.step_slo_ms, parsed.step_hosts, parsed.step_hold, parsed.step_admit) == \
        ([("", 40.0), ("chat", 20.0)], 2, 2.0, "wait")
    ray = next(d for d in render(helm, "serving.kuberay=true", "serving.stepScaler.sloMs=40", "serving.stepScaler.admit=now")
               if d["kind"] == "RayService")
    args = yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"][0]["args"]
    served = config_from_args({key: value for key, value in args.items() if key != "config"})  # what the app reads
    assert (served.step_slo_s, served.step_hosts, served.step_hold_s, served.step_admit) == (0.04, 1, 2.0, "now")
    for value, shown in (("serving.stepScaler.sloMs=0", "serving.stepScaler.sloMs: 0 is not a number of milliseconds"),
                         ("serving.stepScaler.hosts=0", "serving.stepScaler.hosts: 0 is not a whole number >= 1"),
                         ("serving.stepScaler.admit=later", "serving.stepScaler.admit: later is not wait or now"),
                         ("serving.stepScaler.sloMsByModel.chat=0", "serving.stepScaler.sloMsByModel.chat: 0 is not a number")):
        bad = helm_run(helm, "template", "t", str(CHART), "--set", "serving.stepScaler.sloMs=40", "--set", value,
                       check=False)
        assert bad.returncode != 0 and shown in bad.stderr
    ray_own = helm_run(helm, "template", "t", str(CHART), "--set", "serving.kuberay=true", "--set",
                       "serving.stepScaler.sloMs=40", "--set", "serving.stepScaler.sloMsByModel.chat=20", check=False)
    assert ray_own.returncode != 0 and "the Ray app (serving.kuberay) serves one model" in ray_own.stderr
