"""Ping-pong modelled (twin/overlap.py): the golden example and what any costs obey."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from moeless.twin.overlap import LayerCosts, hidden_fraction, pingpong_s, serial_s


def test_the_golden_example():
    costs = LayerCosts(attention_s=2.0, remote_s=2.0, transfer_s=2.0)
    assert serial_s(costs, 2) == 8.0 and pingpong_s(costs, 2) == 5.0
    assert hidden_fraction(costs, 2) == pytest.approx(0.75)


def test_a_split_whose_call_overheads_cost_more_than_it_hides_hides_nothing():
    costs = LayerCosts(attention_s=0.1, remote_s=2.0, transfer_s=1.9, call_s=1.9)
    assert pingpong_s(costs, 4) > serial_s(costs, 4) and hidden_fraction(costs, 4) == 0.0


@given(attention=st.floats(0.0, 10.0), remote=st.floats(0.0, 10.0), layers=st.integers(1, 40), micro=st.integers(1, 4))
def test_without_call_overheads_ping_pong_is_never_slower_nor_faster_than_either_side_alone(attention, remote, layers, micro):
    costs = LayerCosts(attention, remote, remote)
    got = pingpong_s(costs, layers, micro)
    assert got <= serial_s(costs, layers) + 1e-9
    assert got >= layers * max(attention, remote) - 1e-9  # each side still does all its work
    assert 0.0 <= hidden_fraction(costs, layers, micro) <= 1.0
