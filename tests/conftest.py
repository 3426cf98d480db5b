"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter; the flag must be set before
triton is imported anywhere.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["redis_servers"]
