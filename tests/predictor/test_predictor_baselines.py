"""History window and fMoE expert-map matching on hand-made iterations."""

import numpy as np
import pytest
import torch

from moeless.predictor.fmoe import ExpertMapPredictor
from moeless.predictor.history import HistoryPredictor

L, E, K = 3, 4, 2
HIDDEN = torch.zeros(10, 8)  # 10 tokens: forecasts sum to 10 * k = 20


def test_history_is_uniform_before_any_iteration():
    np.testing.assert_allclose(HistoryPredictor(L, E, K).predict(0, 1, HIDDEN, np.zeros((1, E))).load, [5, 5, 5, 5])


def test_history_averages_the_shares_of_the_last_window_iterations():
    p = HistoryPredictor(L, E, K, window=2)
    loads = lambda row: np.tile(np.array(row, float), (L, 1))  # noqa: E731 - the same load on every layer
    p.observe(loads([4, 0, 0, 0]), np.zeros((L, E)))  # pushed out of the window below
    p.observe(loads([2, 2, 0, 0]), np.zeros((L, E)))
    p.observe(loads([0, 0, 0, 10]), np.zeros((L, E)))
    forecast = p.predict(0, 2, HIDDEN, np.zeros((1, E)))
    np.testing.assert_allclose(forecast.load, np.array([0.25, 0.25, 0, 0.5]) * 20)
    assert forecast.topk is None


def test_history_rejects_targets_outside_the_model():
    with pytest.raises(ValueError, match="outside"):
        HistoryPredictor(L, E, K).predict(2, 1, HIDDEN, np.zeros((3, E)))


def test_fmoe_forecasts_with_the_most_similar_trajectory():
    p = ExpertMapPredictor(L, E, K)
    a = np.array([[1, 0, 0, 0]] * L, float)  # an iteration that routes to expert 0 early ...
    b = np.array([[0, 1, 0, 0]] * L, float)
    p.observe(np.array([[8, 0, 0, 0], [8, 0, 0, 0], [0, 0, 2, 6]]), a)  # ... and to experts 2, 3 at layer 2
    p.observe(np.array([[0, 8, 0, 0], [0, 8, 0, 0], [4, 4, 0, 0]]), b)
    current = np.array([[0.9, 0.1, 0, 0], [0.8, 0.2, 0, 0]])  # layers 0..1 look like a
    np.testing.assert_allclose(p.predict(1, 1, HIDDEN, current).load, [0, 0, 5, 15])
    np.testing.assert_allclose(p.predict(0, 2, HIDDEN, np.array([[0.1, 0.9, 0, 0]])).load, [10, 10, 0, 0])


def test_fmoe_forgets_the_oldest_map_beyond_capacity():
    p = ExpertMapPredictor(L, E, K, capacity=1)
    p.observe(np.ones((L, E)), np.eye(E)[[0, 0, 0]])
    p.observe(np.tile([0, 0, 0, 4], (L, 1)), np.eye(E)[[1, 1, 1]])
    # only the second map is left, so even a trajectory like the first one gets its loads
    np.testing.assert_allclose(p.predict(0, 1, HIDDEN, np.eye(E)[[0]]).load, [0, 0, 0, 20])
    assert p.nbytes() == 2 * L * E * 8
