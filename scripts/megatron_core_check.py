"""megatron-core 0.16.1's MoE utilities against moeless's routing, dispatch and combine, on CPU tensors:
same results? how fast? (decode: 4 tokens; prefill: 256 tokens; H=576, E=16, k=8, fake experts).

megatron-core is not a dependency (docs/serving.md says why); in a venv of its own:
    python3.11 -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 megatron-core==0.16.1
    /tmp/mcore/bin/python scripts/megatron_core_check.py
"""
import time
import warnings
warnings.filterwarnings("ignore")
import torch
from megatron.core.transformer.moe.moe_utils import permute, topk_routing_with_score_function, unpermute
torch.set_num_threads(1)
E, k, H = 16, 8, 576

def reference(x, idx, w, experts):
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        token, slot = (idx == e).nonzero(as_tuple=True)
        out.index_put_((token,), experts(e, x[token]) * w[token, slot, None], accumulate=True)
    return out

def fake(e, x):
    return torch.tanh(x * (e + 1)) + e

def moeless_route(logits):  # model/adapters.softmax_topk with renormalise (Mixtral's rule, the default model's)
    w, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), idx

def timeit(f, n=200):
    f(); t = time.perf_counter()
    for _ in range(n): f()
    return 1e6 * (time.perf_counter() - t) / n

for T in (4, 256):
    x, logits = torch.randn(T, H), torch.randn(T, E)
    # 1. routing: top-k of softmax
    probs, rmap = topk_routing_with_score_function(logits, k, score_function="softmax")
    w, idx = moeless_route(logits)
    dense = torch.zeros(T, E).scatter_(1, idx, w)
    same_routing = torch.equal(rmap, dense > 0) and torch.equal(probs, dense)
    # 2. dispatch + combine with the fake experts: megatron permute/unpermute vs the reference
    def mcore():
        rows, _, order = permute(x, rmap)
        counts = rmap.sum(0).tolist()
        ys = torch.cat([fake(e, part) for e, part in enumerate(torch.split(rows, counts)) if part.numel()])
        return unpermute(ys, order, restore_shape=x.shape, probs=probs, routing_map=rmap)
    ours = reference(x, idx, w, fake)
    theirs = mcore()
    print(f"T={T}: routing identical {same_routing}; output bit-identical {torch.equal(ours, theirs)}, "
          f"max abs diff {float((ours - theirs).abs().max()):.3g}; "
          f"routing us: megatron {timeit(lambda: topk_routing_with_score_function(logits, k, score_function='softmax')):.0f}, "
          f"top-k {timeit(lambda: moeless_route(logits)):.0f}; dispatch+combine us: megatron {timeit(mcore, 50):.0f}, "
          f"reference {timeit(lambda: reference(x, idx, w, fake), 50):.0f}")
