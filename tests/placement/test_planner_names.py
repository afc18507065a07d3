"""The planners' names as the knobs and the operator check them (placement/names.py, no kernels) are
the registry's (placement/planner.py): a planner added to one and not the other fails here."""

from moeless.placement.names import DEFAULT_PLANNER, PLANNER_NAMES
from moeless.placement.planner import PLANNERS, STATEFUL_PLANNERS


def test_the_names_are_the_registrys_keys():
    assert PLANNER_NAMES == (*PLANNERS, *STATEFUL_PLANNERS)
    assert next(iter(PLANNERS)) == DEFAULT_PLANNER
