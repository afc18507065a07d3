"""The shared predictor metrics on hand-computed examples."""

import numpy as np
import pytest

from moeless.predictor.metrics import load_accuracy, pearson, straggler_hit, summarise, topk_hit_rate


def test_topk_hit_rate_counts_actual_experts_found_per_token():
    # token 0 finds both of {1, 0}; token 1 finds 2 but not 4: (2 + 1) / 4
    assert topk_hit_rate(np.array([[0, 1], [2, 3]]), np.array([[1, 0], [2, 4]])) == pytest.approx(0.75)
    assert topk_hit_rate(np.array([[5, 6]]), np.array([[1, 2]])) == 0.0


def test_topk_hit_rate_rejects_mismatched_token_counts():
    with pytest.raises(ValueError, match="equal T"):
        topk_hit_rate(np.zeros((3, 2), int), np.zeros((2, 2), int))


def test_load_accuracy_is_one_minus_half_l1_of_shares():
    assert load_accuracy(np.array([2, 2, 0, 0]), np.array([1, 1, 1, 1])) == pytest.approx(0.5)
    assert load_accuracy(np.array([10.0, 30.0]), np.array([1, 3])) == pytest.approx(1.0)  # scale-free
    assert load_accuracy(np.array([1, 0]), np.array([0, 1])) == pytest.approx(0.0)
    batched = load_accuracy(np.array([[1, 0], [1, 1]]), np.array([[1, 0], [1, 0]]))
    np.testing.assert_allclose(batched, [1.0, 0.5])


def test_load_accuracy_of_an_empty_batch_is_undefined():
    assert np.isnan(load_accuracy(np.array([1, 1]), np.array([0, 0])))


def test_pearson_sign_and_undefined_case():
    assert pearson(np.array([1, 2, 3]), np.array([2, 4, 6])) == pytest.approx(1.0)
    assert pearson(np.array([1, 2, 3]), np.array([3, 2, 1])) == pytest.approx(-1.0)
    assert pearson(np.array([1, 0, 1, 0]), np.array([1, 1, 0, 0])) == pytest.approx(0.0)
    assert np.isnan(pearson(np.array([2, 2, 2]), np.array([1, 2, 3])))


def test_straggler_hit_accepts_any_of_tied_actual_maxima():
    np.testing.assert_array_equal(straggler_hit(np.array([[0, 5, 1], [5, 0, 1]]), np.array([[0, 3, 3], [0, 3, 3]])), [1.0, 0.0])


def test_summarise_means_over_cases_and_marks_load_only_methods():
    pred = np.array([[1, 0], [1, 1]])
    true = np.array([[1, 0], [1, 0]])
    s = summarise(pred, true)
    assert s["load_acc"] == pytest.approx(0.75)
    assert s["straggler"] == pytest.approx(1.0)  # both predictions put expert 0 first (argmax ties go low)
    assert s["pearson"] == pytest.approx(1.0)  # the second case is undefined and skipped
    assert np.isnan(s["topk_hit"])
    assert summarise(pred, true, topk_hit=0.5)["topk_hit"] == 0.5
