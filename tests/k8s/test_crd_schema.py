"""The CRD's OpenAPI schema and controller/knobs.py cannot drift apart; the chart ships the same CRD."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from moeless.controller.operator.spec import HostPool, PolicySpec, Scaling, _POOL_KEYS
from moeless.controller.operator.pool_spec import PoolSpec
from moeless.controller.knobs import BY_KEY, PREDICTORS, KnobError, Knobs

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "manifests" / "crd.yaml"
CHART_CRD = ROOT / "helm" / "moeless" / "crds" / "moeless.io.yaml"


def schema(kind: str = "ExpertAutoscalingPolicy") -> dict:
    crd = next(d for d in yaml.safe_load_all(CRD.read_text()) if d["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_an_expert_pool_sizes_its_hosts_with_the_policy_s_own_blocks():
    policy, pool = schema(), schema("ExpertPool")
    for key in ("prewarm", "scaleToZero", "upscaleDelaySeconds"):
        assert _no_descriptions(pool[key]) == _no_descriptions(policy[key]), key
    assert _no_descriptions(pool["hosts"]) == _no_descriptions(policy["hosts"])
    pool_defaults = {f.name: f.default for f in dataclasses.fields(PoolSpec) if f.default is not dataclasses.MISSING}
    assert pool["keepAliveSeconds"]["default"] == pool_defaults["keep_alive_s"] == Knobs().keep_alive_s
    assert pool["storage"]["properties"]["mountPath"]["default"] == pool_defaults["mount_path"]


def _no_descriptions(node):
    if isinstance(node, dict):
        return {k: _no_descriptions(v) for k, v in node.items() if k != "description"}
    return node


def accepts(key: str, value) -> bool:
    try:
        BY_KEY[key].parse(value, key)
        return True
    except KnobError:
        return False


def test_the_chart_ships_the_manifests_crd():
    assert CHART_CRD.read_text() == CRD.read_text(), "copy manifests/crd.yaml to helm/moeless/crds/"


def test_serving_block_has_exactly_the_knobs():
    assert set(schema()["serving"]["properties"]) == set(BY_KEY)


@pytest.mark.parametrize("key", sorted(BY_KEY))
def test_each_knob_has_the_same_type_and_range(key):
    prop = schema()["serving"]["properties"][key]
    assert "default" not in prop, "serving defaults come from Knobs, not the CRD"
    default = getattr(Knobs(), BY_KEY[key].attr)
    kind = prop["type"]
    if kind == "boolean":
        assert accepts(key, True) and accepts(key, False) and not accepts(key, 1)
        return
    if kind == "string":
        if "enum" in prop:
            assert tuple(prop["enum"]) == PREDICTORS
            assert all(accepts(key, v) for v in prop["enum"]) and not accepts(key, "other")
        else:  # planner names: checked by the operator (KnobError), not by an enum
            assert accepts(key, default) and not accepts(key, "") and prop["minLength"] == 1
        return
    assert kind in ("integer", "number")
    assert (kind == "integer") == isinstance(default, int)
    if kind == "integer":
        assert not accepts(key, 2.5)
    step = 1 if kind == "integer" else 1e-9
    low = prop.get("minimum")
    if low is None:
        assert accepts(key, -1e9 if kind == "number" else -10**9)
    elif prop.get("exclusiveMinimum"):
        assert not accepts(key, low) and accepts(key, low + step)
    else:
        assert accepts(key, low) and not accepts(key, low - step)
    high = prop.get("maximum")
    if high is None:
        assert accepts(key, 10**9)
    else:
        assert accepts(key, high) and not accepts(key, high + step)
    assert bool(prop.get("nullable")) == accepts(key, None)


def test_crd_defaults_are_the_operators_defaults():
    props = schema()
    hosts = props["hosts"]["properties"]
    pool_defaults = {f.name: f.default for f in dataclasses.fields(HostPool) if f.default is not dataclasses.MISSING}
    for key, (attr, _) in _POOL_KEYS.items():
        if attr in pool_defaults:
            assert hosts[key].get("default") == pool_defaults[attr], key
        else:
            assert "default" not in hosts[key] and key in props["hosts"]["required"]
    spec_defaults = {f.name: f.default for f in dataclasses.fields(PolicySpec)}
    scaling = {f.name: f.default for f in dataclasses.fields(Scaling)}
    assert props["prewarm"]["properties"]["hosts"]["default"] == scaling["prewarm_hosts"]
    assert props["scaleToZero"]["properties"]["enabled"]["default"] == scaling["scale_to_zero"]
    assert props["scaleToZero"]["properties"]["delaySeconds"]["default"] == scaling["scale_to_zero_delay_s"]
    # Top-level scaling fields have no schema default: the API server would set them on a policy on an
    # ExpertPool too, where they belong to the pool (spec.py refuses them there). The operator's default:
    assert "default" not in props["upscaleDelaySeconds"] and scaling["upscale_delay_s"] == 30.0
    assert "default" not in props["downscaleDelaySeconds"]  # unset: keepAliveSeconds
    assert props["nonExpert"]["properties"]["memoryGiBPerReplica"]["default"] == spec_defaults["non_expert_gib_per_replica"]


# The JSONSchemaProps fields a structural schema may use (apiextensions.k8s.io/v1).
SCHEMA_KEYS = {"type", "description", "default", "properties", "items", "additionalProperties", "required", "enum",
               "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems",
               "maxItems", "pattern", "format", "nullable", "anyOf", "oneOf", "allOf", "not",
               "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string", "x-kubernetes-validations",
               "x-kubernetes-list-type", "x-kubernetes-map-type"}


def _strays(node: dict, where: str) -> list[str]:
    """Keys of a schema node that are no schema field (a comma in a flow mapping's unquoted text once
    split a description into a stray key), with their paths."""
    out = [f"{where}.{k}" for k in node if k not in SCHEMA_KEYS]
    for name, child in (node.get("properties") or {}).items():
        out += _strays(child, f"{where}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _strays(node[key], f"{where}.{key}")
    return out


@pytest.mark.parametrize("kind", ["ExpertAutoscalingPolicy", "ExpertPool"])
def test_every_schema_node_holds_only_schema_fields(kind):
    crd = next(d for d in yaml.safe_load_all(CRD.read_text()) if d["spec"]["names"]["kind"] == kind)
    assert _strays(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], kind) == []


def test_the_compute_dtypes_are_the_operator_s():
    from moeless.expert_fn.options import COMPUTE_DTYPES

    for kind in ("ExpertAutoscalingPolicy", "ExpertPool"):
        prop = schema(kind)["hosts"]["properties"]["computeDtype"]
        assert prop["enum"] == list(COMPUTE_DTYPES) and prop["default"] == HostPool.compute_dtype
