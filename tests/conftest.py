"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter; the flag must be set before
triton is imported anywhere. Hypothesis settings profiles are chosen here.
"""

import os

from hypothesis import settings

os.environ.setdefault("TRITON_INTERPRET", "1")

# Shared, noisy machines: no per-example deadline. CI replays the same examples every run
# (derandomized) so that a red run always means a change broke something; local runs keep
# exploring new examples.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

pytest_plugins = ["redis_servers"]
