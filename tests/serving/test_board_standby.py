"""The placement board's standby placements (controller/planning/board.py) on a real Ray: a
replica's follower switches to one at once, keeps it against a narrower board placement while
pinned, and follows the board again after."""

import time

import numpy as np

from moeless.controller.planning.board import BoardFollower, publish_placement, publish_standby, spanned
from moeless.placement.types import LayerPlacement, Placement
from moeless.serving.placement_source import PlacementSource

BOARD = "test-standby-board"


def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the follower did not catch up"
        time.sleep(0.01)


def test_a_follower_switches_to_a_standby_placement_and_is_pinned_to_its_width(ray_serve):
    narrow = Placement(tuple(LayerPlacement.even(np.arange(4), np.zeros(4, int), 4) for _ in range(2)), 4, 3)
    wide = Placement.static(2, 4, 3)
    assert (spanned(narrow), spanned(wide)) == (1, 3)
    source = PlacementSource(narrow)
    follower = BoardFollower(source, interval_s=0.02, name=BOARD)
    try:
        assert not follower.switch(3, 1.0)  # nothing on standby yet
        publish_standby({3: wide}, BOARD)
        _until(lambda: 3 in follower.standby)
        assert not follower.switch(4, 1.0)  # none that wide
        assert follower.switch(2, 1.0) and source.placement is not narrow  # the fewest hosts >= 2 on standby: 3
        assert spanned(source.placement) == 3
        seen = follower.seen
        publish_placement(narrow, BOARD)  # a pass planned before the widening reached the loop
        time.sleep(0.3)
        assert spanned(source.placement) == 3 and follower.seen == seen  # pinned: not taken
        version = publish_placement(wide, BOARD)  # the loop's own answer
        _until(lambda: follower.seen == version)
        assert spanned(source.placement) == 3
        publish_placement(narrow, BOARD)  # the loop narrowed: followed once the pin ends
        _until(lambda: spanned(source.placement) == 1, timeout_s=5.0)
    finally:
        follower.close()
