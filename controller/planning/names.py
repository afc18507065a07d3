"""The Ray names the planning loop and the placement board are registered under.

Apart from actor.py and board.py so that what only needs a name (serving's config, a bench on a
machine without Ray) does not import Ray.
"""

NAMESPACE = "moeless"
LOOP_NAME = "moeless-plan-loop"
BOARD_NAME = "moeless-placement-board"
