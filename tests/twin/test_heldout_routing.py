"""What the main FLAME log (flame-moe-290m: 4 windows x 512 tokens) says about routing, checked on
windows it does not hold (flame-moe-290m-heldout: the first 10 tokens of 60 other windows), which
nothing in moeless is fitted on. docs/deployments.md ("Routing logs") reports these numbers.

1. Which experts are popular transfers: per layer, the main log's expert counts correlate with the
   held-out's (measured: r = 0.42 averaged over the 8 layers; chance is 0 +- 0.045). The control
   pairs each held-out layer with the next main layer and lands at chance (-0.07): the check fails
   on a log whose layers or expert ids are mis-mapped.
2. How skewed popularity is does not transfer: beyond the sampling noise of its token count, the
   main log's per-layer skew (CV of expert counts) is 2.4x the held-out's (0.20 vs 0.08). Four
   windows of one document each concentrate routing; a batch from many requests would not.
   Hence a forecast of the held-out counts from the main log's shares is worse than a uniform one
   (squared error 1.66x), and better (0.83x) only when shrunk to a quarter of its skew.
3. Consecutive tokens share experts about as often as any two tokens of the same window (0.106 vs
   0.099 of k; 0.094 for uniform picks): no temporal locality beyond popularity, which is all a
   decode step formed from this log (twin/chunked.split_counts) can carry.
"""

from __future__ import annotations

import numpy as np
import pytest

from moeless.traces.routing_file import Routing
from moeless.twin.routing import cumulative_counts


def counts(routing: Routing) -> np.ndarray:
    """[L, E] picks per (layer, expert) over the whole log, through the twin's own counting."""
    return sum(cum[-1] for cum in cumulative_counts(routing)).astype(np.float64)


def excess_skew(c: np.ndarray, top_k: int) -> np.ndarray:
    """Per layer, the CV of expert counts beyond what n tokens of uniform top-k picks give
    (CV^2 = (1 - p) / (n p), p = k / E): a skew that does not shrink as the log grows."""
    n, p = c.sum(1) / top_k, top_k / c.shape[1]
    cv2 = (c.std(1) / c.mean(1)) ** 2
    return np.sqrt(np.maximum(cv2 - (1 - p) / (n * p), 0.0))


@pytest.fixture(scope="module")
def logs(shipped) -> tuple[np.ndarray, np.ndarray]:
    return counts(shipped["flame-moe-290m"]), counts(shipped["flame-moe-290m-heldout"])


def test_which_experts_are_popular_transfers_to_the_heldout_windows(logs):
    main, held = logs
    layers = len(main)
    same = np.mean([np.corrcoef(main[l], held[l])[0, 1] for l in range(layers)])
    shifted = np.mean([np.corrcoef(main[(l + 1) % layers], held[l])[0, 1] for l in range(layers)])
    assert same >= 0.3, f"main vs held-out popularity r = {same:.2f}: no transfer"
    assert abs(shifted) < 0.15, f"mis-mapped layers still correlate (r = {shifted:.2f}): the check cannot fail"


def test_how_skewed_popularity_is_does_not_transfer(logs):
    main, held = logs
    fitted, unseen = excess_skew(main, 6).mean(), excess_skew(held, 6).mean()
    assert 0.15 < fitted < 0.25 and 0.04 < unseen < 0.12
    assert fitted / unseen > 1.8, f"skew main {fitted:.3f} vs held-out {unseen:.3f}: update docs/deployments.md"
    # The consequence for a forecast fitted on the main log: its raw shares lose to uniform on the held-out.
    n = held.sum(1, keepdims=True)
    shares = main / main.sum(1, keepdims=True)
    uniform = ((held - n / held.shape[1]) ** 2).sum()

    def error(shrink: float) -> float:
        return float(((n * (1 / held.shape[1] + shrink * (shares - 1 / held.shape[1])) - held) ** 2).sum() / uniform)

    assert error(1.0) > 1.3 and error(0.25) < 0.9


def test_consecutive_tokens_overlap_about_as_any_two_of_a_window(shipped):
    routing = shipped["flame-moe-290m"]
    k, rng = routing.top_k, np.random.default_rng(0)

    def overlap(a: np.ndarray, b: np.ndarray) -> float:  # [n, L, k] each -> mean shared experts / k
        return float((a[..., :, None] == b[..., None, :]).sum(-1).sum(-1).mean() / k)

    windows = [routing.request(r) for r in range(len(routing.lengths))]
    consecutive = np.mean([overlap(w[:-1], w[1:]) for w in windows])
    i, j = rng.integers(0, 512, (2, 20_000))
    far = np.abs(i - j) > 1
    anywhere = np.mean([overlap(w[i[far]], w[j[far]]) for w in windows])
    assert anywhere < consecutive < anywhere + 0.02 and consecutive < 0.12  # uniform picks: k / E = 0.094
