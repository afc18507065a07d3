"""Serving a base and its fine-tunes by name (BASE+FINETUNE: serving/config.py, serving/embedded.py): the
HTTP app answers each exactly as its merged model alone; `moeless serve` and `moeless bench
finetunes` run them on hosts that hold each shared expert once; bad fine-tunes are refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moeless.controller.knobs import KnobError
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.finetune import FinetuneError, base_record, merge_experts, save_esft
from moeless.model.tiny import tiny_model
from moeless.serving.config import choose_model
from moeless.serving.embedded import _store

CHANGED = {"code": [(0, 1), (1, 3)], "chat": [(1, 0)]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding two ESFT artefacts of tiny_model("mixtral", 0) under finetunes/ (experts perturbed)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELESS_CACHE", str(root))
        base = tiny_model("mixtral", 0)
        for seed, (name, experts) in enumerate(CHANGED.items(), 1):
            g = torch.Generator().manual_seed(seed)
            weights = {key: {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.expert_weights(*key).items()}
                       for key in experts}
            save_esft(root / "finetunes" / name, merge_experts(base, weights), experts,
                      {"name": name, "base": base_record(base, "tiny-mixtral"), "task": "none"})
        yield root


def test_a_fine_tune_is_named_after_its_base_and_loads_merged(cache):
    choice = choose_model("tiny:mixtral+code")
    assert choice.name == "tiny-mixtral+code" and choice.base.name == "tiny-mixtral"
    merged, base = choice.loader(), tiny_model("mixtral", 0)
    for layer, expert, weights in merged.iter_experts():
        same = all(torch.equal(t, base.expert_weights(layer, expert)[n]) for n, t in weights.items())
        assert same == ((layer, expert) not in CHANGED["code"])
    with pytest.raises(SystemExit, match=r"^--model 'tiny:mixtral\+nothing': .*finetune\.json: missing"):
        choose_model("tiny:mixtral+nothing")
    with pytest.raises(FinetuneError) as err:  # another base: refused in one line naming the fine-tune
        choose_model("tiny:qwen2_moe+code").loader()
    assert "\n" not in str(err.value) and str(err.value).startswith("fine-tune code")


@pytest.mark.parametrize("engines", ["one", "one_hosts_naming_them_otherwise", "per_model"])
def test_one_app_serves_a_base_and_its_fine_tunes_each_exactly(cache, ray_serve, reference_text, engines):
    """One engine for the base and its ESFT fine-tunes (serving/family.py), or one engine per model. The
    hosts may serve them by other names than clients use (a pool's: its policies', family_hosts)."""
    import httpx
    from ray import serve

    from moeless.serving.app import build_app
    from moeless.serving.config import ServeConfig

    choices = [choose_model(m) for m in ("tiny:mixtral", "tiny:mixtral+code", "tiny:mixtral+chat")]
    models, written = {c.name: c.loader() for c in choices}, {}
    renamed = engines == "one_hosts_naming_them_otherwise"
    on_hosts = {c.name: (f"policy-{i}" if renamed else c.name) for i, c in enumerate(choices)}
    stores = [(on_hosts[c.name], _store(c, models[c.name], written)) for c in choices]
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        family = tuple(c.name for c in choices[1:]) if engines != "per_model" else ()
        hosts_family = tuple(on_hosts[n] for n in family) if renamed else ()
        configs = [ServeConfig(c.name, c.loader, tuple(group.addresses), replica_cpus=0.1, ingress_cpus=0.1,
                               host_model=on_hosts[c.name], family=family if c is choices[0] else (),
                               family_hosts=hosts_family if c is choices[0] else ())
                   for c in (choices[:1] if family else choices)]
        serve.run(build_app(configs), name="moeless", route_prefix="/")
        listed = httpx.get(ray_serve + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == ["tiny-mixtral", "tiny-mixtral+code", "tiny-mixtral+chat"]
        for name, model in models.items():
            for prompt in ("The cat sat", "A fine day"):
                r = httpx.post(ray_serve + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 6},
                               timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference_text(model, prompt, 6), (name, prompt)
        assert httpx.get(ray_serve + "/metrics", timeout=60).status_code == 200  # one engine's stats once
        held = []
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                held += [r for r in host.status()["replicas"] if r["bytes"]]
        spec = models["tiny-mixtral"].spec
        assert len(held) <= spec.num_layers * spec.num_experts + sum(len(v) for v in CHANGED.values())
        assert any(len(r["models"]) == 3 for r in held)  # experts no fine-tune changed: one replica for all three
        serve.delete("moeless")


def test_moeless_serve_runs_a_base_and_a_fine_tune_on_the_same_hosts(cache):
    env = dict(os.environ, MOELESS_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-m", "moeless", "serve", "--model", "tiny:mixtral", "--model",
                           "tiny:mixtral+code", "--port", "0", "--demo", "--predictor", "history"],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "moeless is serving tiny-mixtral, tiny-mixtral+code at" in proc.stdout and "\nassistant: " in proc.stdout


def test_moeless_serve_on_given_hosts_serves_one_family_engine_and_says_what_it_needs(cache, capsys):
    """On hosts from $MOELESS_EXPERT_HOSTS several models are one engine: a base and fine-tunes of it, the
    pool's address naming what its hosts serve them by (&family=); otherwise one line says what to do."""
    from moeless.serving.embedded import serve_embedded

    pool = "k8s://ns/base:50051?slots=2&pool=p&model=base"
    refusals = [  # (MOELESS_EXPERT_HOSTS, --model ..., the one line that refuses them)
        ("127.0.0.1:1", ["tiny:mixtral", "tiny:mixtral+code"],
         r"^\$MOELESS_EXPERT_HOSTS: several models on hosts given as a list need a pool's address"),
        (pool, ["tiny:mixtral", "tiny:mixtral+code"],
         r"^\$MOELESS_EXPERT_HOSTS names 0 fine-tunes of tiny-mixtral's engine \(&family=NAME,...: .*\), --model 1 "
         r"\(tiny-mixtral\+code\)"),
        (pool, ["tiny:mixtral", "tiny:qwen2_moe"],
         r"^--model tiny-qwen2_moe: on the expert hosts of \$MOELESS_EXPERT_HOSTS several models are one engine, "
         r"the first \(tiny-mixtral\)"),
        (pool + "&family=code", ["tiny:mixtral", "tiny:mixtral+code", "tiny:mixtral+chat"],
         r"names 1 fine-tunes of tiny-mixtral's engine .*, --model 2 \(tiny-mixtral\+code, tiny-mixtral\+chat\): "
         r"give each fine-tune in both"),
        (pool + "&family=code", "tiny:mixtral", r"names 1 fine-tunes of tiny-mixtral's engine .*, --model 0 \(none\)"),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELESS_CACHE", str(cache))
        for hosts, models, words in refusals:
            mp.setenv("MOELESS_EXPERT_HOSTS", hosts)
            with pytest.raises(KnobError, match=words):
                serve_embedded(models)
    assert "loading model" not in capsys.readouterr().out  # refused before any model is loaded


def test_bench_finetunes_quick_holds_each_shared_expert_once_and_answers_exactly(tmp_path):
    """`moeless bench finetunes --quick` in its own process (its own Ray): tiny:mixtral and 3 stand-ins."""
    env = dict(os.environ, MOELESS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "moeless", "bench", "finetunes", "--quick", "--requests", "8",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((tmp_path / "finetunes.json").read_text())
    spec = tiny_model("mixtral", 0).spec
    own = spec.num_layers * 1  # a stand-in changes round(0.125 x 4) = 1 expert of each layer (at least one)
    assert doc["stand_ins"] and len(doc["finetunes"]) == 3
    assert doc["whole_models_memory_ratio"] == 4.0
    assert doc["memory_ratio"] == pytest.approx((spec.num_layers * spec.num_experts + 3 * own) / (spec.num_layers * spec.num_experts))
    assert set(doc["runs"]) == {"base_alone", "one_engine"}  # --quick: no run of one engine per model
    for name in ("one_engine",):
        together = doc["runs"][name]
        assert together["failed"] == 0 and together["identical_to_merged_alone"] == together["checked"] == 8
        assert together["memory"]["parts_add_up"] and set(together["memory"]["models"]) == {doc["base"], *doc["finetunes"]}
        assert doc["throughput_ratio"][name] > 0
    assert "one_engine: throughput" in run.stdout and "expert memory" in run.stdout
