"""How many threads torch computes the model with on a CPU.

torch's own default is one thread per core. On a small shared machine that is the slowest
choice: OpenMP's threads spin-wait for each other at every small matmul, and a core taken by
anything else (the connector's loader and writer threads, a daemon, another process) stalls
them all. A 737-token cold prefill of SmolLM2-135M on 2 shared cores took 3.4 s with 1 thread
and 16.7 s with 2 (medians of 4 interleaved rounds, load average 3.3-4.6), 4.1 s and 22.7 s
at load 7.4-8.6; issue 34 measured 7.2 s against 19.6 s. So the engine computes with one thread less than the cores this
process may use (``os.sched_getaffinity``: a container's or ``taskset``'s limit, not the
machine's core count), at least one: the spare core serves the rest of the process.

The default is set when the engine is imported, so that whatever the program sets later wins
(``torch.set_num_threads``, a benchmark's ``--threads``); so do ``OMP_NUM_THREADS`` and
``MKL_NUM_THREADS`` (the default is not set then) and ``EngineConfig.threads`` (set when an
``LLM`` is built; torch's thread count is the process's, not one engine's).
"""

from __future__ import annotations

import os

import torch

_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_default: int | None = None  # what set_default set, None if the environment chose


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(cores: int) -> int:
    """One less than ``cores``, at least one."""
    return max(1, cores - 1)


def set_default() -> None:
    """Set torch's thread count to the engine's default unless the environment names one."""
    global _default
    if any(os.environ.get(name) for name in _ENV):
        return
    _default = default_threads(usable_cores())
    torch.set_num_threads(_default)


def apply(configured: int | None) -> str:
    """Set torch's thread count to ``configured`` (None: keep it) and return one line that says
    what it is and who chose it, for the engine's start."""
    if configured is not None:
        torch.set_num_threads(configured)
    n = torch.get_num_threads()
    if configured is not None:
        why = "EngineConfig.threads, --threads"
    elif env := next((name for name in _ENV if os.environ.get(name)), None):
        why = f"{env}={os.environ[env]}"
    elif n == _default:
        why = f"one less than the {usable_cores()} cores this process may use, at least 1; --threads or " \
              "EngineConfig.threads sets another"
    else:
        why = "set by the program with torch.set_num_threads"
    return f"{n} torch thread{'s' if n != 1 else ''} ({why})"
