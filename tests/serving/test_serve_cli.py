"""`moeless serve` refuses bad knobs with one clear line and exit code 2, before anything starts
(through the real CLI entry point: main(), and once as a subprocess); the knobs reach the app."""

import os
import subprocess
import sys

import pytest

from moeless.cli import main


def one_error_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, words", [
    (["--planner", "fastest"], ["--planner", "fastest"]),
    (["--predictor", "oracle"], ["--predictor", "must be one of gate, history, off", "oracle"]),
    (["--keep-alive", "-1"], ["--keep-alive", "must be >= 0", "-1"]),
    (["--distance", "5", "--model", "tiny:mixtral"], ["distance: 5 layers reaches past the model's 2 MoE layers",
                                                       "use 1..1"]),
    (["--no-placer", "--planner", "static"], ["scaler/placer", "planner is 'static'"]),
    (["--step-slo-ms", "40", "50"], ["--step-slo-ms: one bare MS", "got 2 bare"]),
    (["--step-slo-ms", "code=20"], ["--step-slo-ms: one bare MS", "got 0 bare"]),
    (["--step-slo-ms", "40", "chat=20", "--model", "tiny:mixtral"], ["--step-slo-ms chat=MS: no --model chat is served"]),
])
def test_bad_knob_is_one_line_exit_2(capsys, argv, words):
    line = one_error_line(capsys, ["serve", *argv])
    assert line.startswith("moeless serve: "), line
    for word in words:
        assert word in line, (word, line)


def test_step_slos_reach_the_step_scaler_each_engine_its_own_models():
    from moeless.cli import build_parser
    from moeless.serving.cli import _step_scaler
    from moeless.serving.embedded import _engine_step

    args = build_parser().parse_args(["serve", "--step-slo-ms", "40", "default+code=20", "chat=60.5", "--step-hosts", "2"])
    step = _step_scaler(args)
    assert step == {"step_slo_s": 0.04, "step_slos_s": (("default+code", 0.02), ("chat", 0.0605)), "step_hosts": 2,
                    "step_hold_s": 2.0, "step_admit": "wait"}
    assert _engine_step(step, ("default", "default+code"))["step_slos_s"] == (("default+code", 0.02),)
    assert _engine_step(None, ("default",)) == {}
    assert _step_scaler(build_parser().parse_args(["serve"])) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--step-slo-ms", "40", "chat=fast"])


def test_a_serve_config_takes_step_slos_of_its_own_engines_models_only():
    from moeless.model.tiny import tiny_model
    from moeless.serving.config import ServeConfig

    live = {"plan_loop": "loop", "knobs": object(), "placement_board": "board", "step_slo_s": 0.04}
    config = ServeConfig("base", tiny_model, ("a:1",), family=("base+code",), host_model="base", **live,
                         step_slos_s=(("base+code", 0.02),))
    assert dict(config.step_slos_s) == {"base+code": 0.02}
    for bad in ((("chat", 0.02),), (("base+code", 0.0),)):
        with pytest.raises(ValueError, match="each a model of this engine \\(base, base\\+code\\) with an SLO > 0"):
            ServeConfig("base", tiny_model, ("a:1",), family=("base+code",), host_model="base", **live, step_slos_s=bad)
    with pytest.raises(ValueError, match="beside step_slo_s"):
        ServeConfig("base", tiny_model, ("a:1",), step_slos_s=(("base", 0.02),))


def test_a_config_key_that_does_not_exist(tmp_path, capsys):
    config = tmp_path / "knobs.yaml"
    config.write_text("planner: moeless\nkeepAlive: 30\n")
    line = one_error_line(capsys, ["serve", "--config", str(config)])
    assert line.startswith("moeless serve: ") and "keepAlive" in line and "keepAliveSeconds" in line, line


def test_bad_expert_hosts_env(monkeypatch, capsys):
    monkeypatch.setenv("MOELESS_EXPERT_HOSTS", "host-without-port")
    line = one_error_line(capsys, ["serve", "--model", "tiny:mixtral"])
    assert "MOELESS_EXPERT_HOSTS" in line and "'host-without-port' is not host:port" in line, line


def test_unknown_planner_through_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "moeless", "serve", "--planner", "nope"], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--planner" in lines[0] and "'nope'" in lines[0], proc.stderr


def test_app_from_args_reads_the_knobs_file_and_the_hosts(tmp_path, monkeypatch):
    from moeless.controller.knobs import KnobError
    from moeless.serving.config import config_from_args

    config = tmp_path / "knobs.yaml"
    config.write_text("planner: moeless\npredictor: history\ndistance: 1\nkeepAliveSeconds: 7\n")
    monkeypatch.setenv("MOELESS_EXPERT_HOSTS", "a:1,b:2")
    serve = config_from_args({"config": str(config), "model": "tiny:mixtral", "replicas": 2})
    assert serve.host_addresses == ("a:1", "b:2") and serve.num_replicas == 2 and serve.plan_loop
    assert serve.knobs.predictor == "history" and serve.knobs.keep_alive_s == 7.0
    assert config_from_args({"hosts": "c:3", "model": "tiny:mixtral"}).host_addresses == ("c:3",)
    assert serve.transport == "auto" and config_from_args({"hosts": "c:3", "transport": "tcp"}).transport == "tcp"
    with pytest.raises(KnobError, match="transport 'rdma'; use one of auto, local, tcp, nixl, grpc"):
        config_from_args({"hosts": "c:3", "transport": "rdma"})
    with pytest.raises(KnobError, match="unknown key 'port'"):
        config_from_args({"port": 1})
    assert (serve.micro_batches, serve.micro_batch_tokens) == (1, 256)
    split = config_from_args({"hosts": "c:3", "micro_batches": 2, "micro_batch_tokens": 64})
    assert (split.micro_batches, split.micro_batch_tokens) == (2, 64)
    with pytest.raises(KnobError, match="micro_batches and micro_batch_tokens must be >= 1, got 0 and 256"):
        config_from_args({"hosts": "c:3", "micro_batches": 0})
    with pytest.raises(KnobError, match="must be whole numbers"):
        config_from_args({"hosts": "c:3", "micro_batch_tokens": "lots"})
    assert serve.step_slo_s is None  # the step scaler: off unless asked for
    step = config_from_args({"hosts": "c:3", "step_slo_ms": 40, "step_hosts": 2})
    assert (step.step_slo_s, step.step_hosts, step.step_hold_s, step.step_admit) == (0.04, 2, 2.0, "wait")
    assert config_from_args({"hosts": "c:3", "step_slo_ms": 40, "step_admit": "now"}).step_admit == "now"
    with pytest.raises(KnobError, match="step_admit 'later'; use one of wait, now"):
        config_from_args({"hosts": "c:3", "step_slo_ms": 40, "step_admit": "later"})
    with pytest.raises(KnobError, match="step_slo_ms > 0"):
        config_from_args({"hosts": "c:3", "step_slo_ms": 40, "step_hosts": 1.5})
    monkeypatch.delenv("MOELESS_EXPERT_HOSTS")
    with pytest.raises(KnobError, match="no expert hosts"):
        config_from_args({"model": "tiny:mixtral"})


def test_serve_uses_the_expert_hosts_named_in_the_environment(hosts, tmp_path):
    """With MOELESS_EXPERT_HOSTS set (the Helm chart's Deployment), `moeless serve` starts no hosts of
    its own: the demo request is answered by the hosts given, which see the calls."""
    from moeless.expert_fn.client.client import ExpertHostClient

    env = dict(os.environ, MOELESS_CACHE=str(tmp_path), MOELESS_EXPERT_HOSTS=",".join(hosts.addresses))
    proc = subprocess.run([sys.executable, "-m", "moeless", "serve", "--model", "tiny:mixtral", "--port", "0", "--demo",
                           "--predictor", "history"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"using 3 expert hosts from $MOELESS_EXPERT_HOSTS: {', '.join(hosts.addresses)}" in proc.stdout
    assert "starting" not in proc.stdout and "\nassistant: " in proc.stdout
    assert "s per GB·s (memory-neutral)" in proc.stdout  # the price the loop resolved, said at start
    for address in hosts.addresses:
        with ExpertHostClient(address) as client:
            assert client.status()["meters"]["invocations"] > 0, address


def test_a_transport_the_clients_do_not_have_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--transport", "rdma"])
    assert stop.value.code == 2 and "--transport: invalid choice: 'rdma'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--micro-batches", "--micro-batch-tokens"])
def test_a_micro_batch_split_below_one_is_refused(capsys, flag):
    with pytest.raises(SystemExit) as stop:
        main(["serve", flag, "0"])
    assert stop.value.code == 2 and f"{flag}: must be at least 1, got 0" in capsys.readouterr().err
