"""Routing as a workload: the importer on good and bad logs, the project's capture, a recorded
checkpoint, and token ranges turned into loads."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from moeless.cli import main
from moeless.traces.routing_file import Routing, RoutingError, load_routing, save_routing
from moeless.traces.routing_import import import_routing
from moeless.twin.routing import cumulative_counts, token_loads


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def good_records(layers=(0, 1), tokens=3, keys=("req_id", "token_idx", "layer", "topk_ids")):
    req, tok, lay, ids = keys
    return [{req: f"r{r}", tok: t, lay: l, ids: [(t + l + r) % 4, (t + l + r + 1) % 4], "topk_weights": [0.6, 0.4]}
            for r in range(2) for t in range(tokens) for l in layers]


def test_import_good_log(tmp_path):
    routing = import_routing(write(tmp_path / "a.jsonl", good_records()))
    assert routing.topk.shape == (6, 2, 2) and routing.num_experts == 4 and routing.lengths.tolist() == [3, 3]
    assert routing.request(1)[2, 1].tolist() == [0, 1]  # r=1, t=2, l=1: ids 4 % 4, 5 % 4
    assert routing.weights.shape == (6, 2, 2)
    # Other key names, layer ids naming only MoE layers (mapped to 0..L-1), --experts above the max id.
    other = import_routing(write(tmp_path / "b.jsonl", good_records((1, 3), keys=("problem_id", "token_pos", "layer_id", "experts"))), 8)
    assert other.num_experts == 8 and other.num_layers == 2
    save_routing(tmp_path / "r.npz", routing)
    again = load_routing(tmp_path / "r.npz")
    assert np.array_equal(again.topk, routing.topk) and again.label == routing.label


@pytest.mark.parametrize("mutate, experts, message", [
    (lambda rs: rs.__setitem__(3, {**rs[3], "topk_ids": [0, 9]}), 4, "line 4: field 'topk_ids': expert id 9 out of range 0..3"),
    (lambda rs: rs.__setitem__(2, {**rs[2], "topk_ids": [0, 1, 2]}), None, "line 3: field 'topk_ids' has 3 experts, earlier lines have 2"),
    (lambda rs: rs.pop(5), None, "line 5: field 'layer': request r0 token 2 lacks layers [1]"),
    (lambda rs: rs.__setitem__(1, "{not json"), None, "line 2: not valid JSON"),
    (lambda rs: rs.__setitem__(0, {"req_id": 1, "token_idx": 0, "layer": 0}), None, "line 1: no experts field; expected one of topk_ids"),
    (lambda rs: rs.__setitem__(0, {**rs[0], "token_idx": "x"}), None, "line 1: field 'token_idx' must be an integer"),
    (lambda rs: rs.__setitem__(1, {**rs[1], "layer": 0}), None, "line 2: field 'layer': request r0 token 0 has layer 0 twice (first at line 1)"),
    (lambda rs: rs.clear(), None, "empty file"),
    (lambda rs: rs.__setitem__(3, {**rs[3], "topk_ids": [0, 1.5]}), None, "line 4: field 'topk_ids' must be an integer, got 1.5"),
    (lambda rs: rs[2].pop("topk_ids"), None, "line 3: no experts field; expected one of topk_ids"),
    (lambda rs: rs.__setitem__(1, {**rs[1], "topk_weights": ["a", 0.4]}), None, "line 2: field 'topk_weights' must hold finite numbers"),
    (lambda rs: rs[4].pop("topk_weights"), None, "line 5: field 'topk_weights' must be a list of 2 gate weights"),
    (lambda rs: rs.__setitem__(0, {**rs[0], "phase": "generate"}), None, "line 1: field 'phase' must be \"prefill\" or \"decode\""),
    (lambda rs: rs.__setitem__(1, {**rs[1], "phase": "decode"}), None, "line 2: field 'phase': request r0 token 0 is decode here, not at line 1"),
    (lambda rs: [r.__setitem__("phase", "decode") for r in rs[:2]], None,
     "line 3: field 'phase': request r0 token 1 is prefill after decode token 0"),
])
def test_import_bad_log_names_the_line_and_field(tmp_path, mutate, experts, message):
    records = good_records()
    mutate(records)
    with pytest.raises(RoutingError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        import_routing(write(tmp_path / "bad.jsonl", records), experts)


def test_gzipped_logs_and_bad_gzip(tmp_path, capsys):
    plain = write(tmp_path / "a.jsonl", good_records())
    data = open(plain, "rb").read()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "unnamed.jsonl").write_bytes(gzip.compress(data))  # gzip's bytes without .gz: read as gzip too
    for path in (tmp_path / "a.jsonl.gz", tmp_path / "unnamed.jsonl"):
        assert np.array_equal(import_routing(path).topk, import_routing(plain).topk)
    (tmp_path / "plain.jsonl.gz").write_bytes(data)  # a .gz that is not gzip
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(data)[:-12])  # a truncated one
    for name in ("plain.jsonl.gz", "cut.jsonl.gz"):
        with pytest.raises(RoutingError, match=f"{name}: not a gzip file, or a truncated one"):
            import_routing(tmp_path / name)
    (tmp_path / "latin.jsonl").write_bytes(data.split(b"\n")[0] + b"\n\xff\xfe\n")
    with pytest.raises(RoutingError, match=r"latin.jsonl:line 2: not UTF-8 text"):
        import_routing(tmp_path / "latin.jsonl")
    assert main(["trace", "import", str(tmp_path / "plain.jsonl.gz"), "--out", str(tmp_path / "o.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plain.jsonl.gz: not a gzip file" in err and "Traceback" not in err


def test_import_cli_errors_are_one_line(tmp_path, capsys):
    bad = write(tmp_path / "bad.jsonl", ["[1, 2]"])
    assert main(["trace", "import", bad, "--out", str(tmp_path / "o.npz")]) == 2
    assert "line 1: a record is a JSON object" in capsys.readouterr().err
    assert main(["trace", "import", write(tmp_path / "ok.jsonl", good_records()), "--out", str(tmp_path / "o.npz")]) == 0
    assert "2 requests, 6 tokens, 2 layers, E=4, k=2" in capsys.readouterr().out


def test_project_capture_imports_with_the_same_loads(tmp_path):
    from moeless.traces.request_loads import RequestLoads, save_request_loads

    prefill = np.array([[2, 1, 3, 0], [1, 1, 2, 2]])  # P = 3 tokens, k = 2, L = 2
    decode = np.array([[[1, 1, 0, 0], [0, 0, 1, 1]]])
    save_request_loads(tmp_path / "cap.npz", [RequestLoads(prefill, decode, 3)])
    routing = import_routing(tmp_path / "cap.npz")
    cum = cumulative_counts(routing)[0]
    assert np.array_equal(token_loads(cum, 0, 3), prefill) and np.array_equal(token_loads(cum, 3, 1), decode[0])
    assert all(len(set(row)) == 2 for row in routing.topk.reshape(-1, 2).tolist())  # k distinct experts per token


def test_token_loads_cycle_through_the_routing():
    topk = np.array([[[0]], [[1]], [[1]]])  # one request of 3 tokens, L = 1, k = 1, E = 2
    cum = cumulative_counts(Routing(topk, np.array([3]), np.array([3]), 2, "test"))[0]
    assert token_loads(cum, 1, 2).tolist() == [[0, 2]]
    assert token_loads(cum, 2, 5).tolist() == [[2, 3]]  # tokens 2..6 replay 2, 0, 1, 2, 0


def test_record_a_tiny_checkpoint(tmp_path, capsys):
    from moeless.model.tiny import tiny_hf

    tiny_hf("mixtral").save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "rec.npz"
    assert main(["trace", "record", "--model", str(tmp_path / "ckpt"), "--out", str(out), "--prompts", "humaneval",
                 "--count", "2", "--new-tokens", "3", "--device", "cpu"]) == 0
    routing = load_routing(out)
    assert routing.num_experts == 4 and routing.top_k == 2 and routing.num_layers == 2
    assert (routing.lengths - routing.prompt_tokens).tolist() == [3, 3] and "recorded routing of ckpt" in routing.label
