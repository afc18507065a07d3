"""Each model's last call on a host (expert_fn/host/model_calls.py): its wake-ups, and a fine-tune's
calls loading and keeping its base whole. Pure logic on given times, over a fake model list."""

from __future__ import annotations

from moeless.expert_fn.host.model_calls import ModelCalls

# Models 0 (a base) and 1 (its fine-tune, which replaced the base's (0, 1) by its own (4, 1)) share
# replica (0, 0); model 2 is unrelated.
USERS = {(0, 0): (0, 1), (0, 1): (0,), (4, 1): (1,), (8, 0): (2,)}
FAMILY = {0: frozenset({0, 1}), 1: frozenset({0, 1}), 2: frozenset({2})}


class _Models:
    def users(self, key):
        return USERS[key]

    def base_of(self, model):
        return min(FAMILY[model])

    def base_at(self, key):
        return (0, 1) if key == (4, 1) else None

    def wake_set(self, model, held):
        return [k for k in ([(4, 1)] if model == 1 else []) if not held(k)]


def _calls(family_warm: bool = True) -> ModelCalls:
    return ModelCalls(_Models(), family_warm)


def test_a_model_wakes_at_its_first_call_in_a_keep_alive():
    calls = _calls()
    assert calls.called([1, 0, 1], 0.0, 30.0) == [0, 1]
    assert calls.called([1], 20.0, 30.0) == []  # within the keep-alive
    assert calls.called([0, 1], 45.0, 30.0) == [0]  # model 0 last called at 0: 45 s ago
    assert calls.called([1], 76.0, 30.0) == [1]


def test_a_call_loads_ahead_its_wake_set_then_the_base_where_it_calls_its_own():
    calls = _calls()
    nothing = lambda key: False
    assert calls.ahead([(0, 0)], [1], 0.0, 30.0, nothing) == [((4, 1), 1)]  # waking: its wake set
    assert calls.ahead([(4, 1)], [1], 1.0, 30.0, nothing) == []  # its own (4, 1) not held yet: no base there
    own = lambda key: key == (4, 1)
    assert calls.ahead([(4, 1)], [1], 2.0, 30.0, own) == [((0, 1), 1)]  # held: the base's (0, 1) it replaced
    both = lambda key: key in ((4, 1), (0, 1))
    assert calls.ahead([(4, 1)], [1], 3.0, 30.0, both) == []  # the base's is held already
    assert _calls(family_warm=False).ahead([(4, 1)], [1], 0.0, 30.0, own) == []  # off: no wake set here, no base
    calls.called([0], 4.0, 30.0)
    assert calls.ahead([(4, 1)], [1], 5.0, 30.0, own) == []  # the base calls itself: it loads what it needs


def test_a_calling_fine_tune_keeps_its_base_s_replicas_for_the_models_not_calling():
    calls = _calls()
    assert calls.keeps(0.0, 30.0) is None  # no model called yet
    calls.called([0, 2], 0.0, 30.0)  # the base and an unrelated model: no fine-tune calls, nothing kept
    assert calls.keeps(1.0, 30.0) is None
    calls.called([1], 10.0, 30.0)  # the fine-tune calls
    assert not calls.keeps(25.0, 30.0)((0, 1))  # the base calls too (25 s ago): its keep-alive holds
    calls.called([1], 35.0, 30.0)
    keeps = calls.keeps(36.0, 30.0)  # the base's last call is 36 s old: it may wake
    assert keeps((0, 1)) and keeps((0, 0))  # the base's replicas, shared with the fine-tune or not
    assert not keeps((4, 1))  # the fine-tune's own keep their keep-alive
    assert not keeps((8, 0))  # an unrelated model's
    assert calls.keeps(66.0, 30.0) is None  # the fine-tune's call is past the keep-alive: nothing kept


def test_family_warmth_off_keeps_nothing_and_wake_ups_stay():
    calls = _calls(family_warm=False)
    assert calls.called([1], 0.0, 30.0) == [1]
    assert calls.keeps(1.0, 30.0) is None
