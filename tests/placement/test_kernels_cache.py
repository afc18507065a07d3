"""The planner's kernels compile where numba has nowhere to cache them (a read-only image)."""

import numpy as np

from moeless.placement.kernels import compiled


def test_a_kernel_without_a_cache_location_compiles_in_memory():
    # numba caches by source file; a function whose file does not exist has no cache locator at all,
    # which is what a pod's read-only sources and home look like to numba.
    scope: dict = {}
    exec(compile("def total(x):\n    s = 0.0\n    for v in x:\n        s += v\n    return s\n",
                 "/nonexistent/kernels.py", "exec"), scope)
    kernel = compiled(scope["total"])
    assert kernel(np.arange(5.0)) == 10.0
    assert kernel.signatures  # really compiled by numba, not the Python function
