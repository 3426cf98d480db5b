"""Shared test set-up.

Triton kernels run on CPU tensors under the interpreter; the flag must be set before
triton is imported anywhere. Hypothesis settings profiles are chosen here.
"""

import os
import socket

import pytest
from hypothesis import settings

os.environ.setdefault("TRITON_INTERPRET", "1")

# Shared, noisy machines: no per-example deadline. CI replays the same examples every run
# (derandomized) so that a red run always means a change broke something; local runs keep
# exploring new examples.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

pytest_plugins = ["redis_servers"]

DEFAULT_ADDRESS = ("127.0.0.1", 50051)  # the daemon's, the client's and the README's default


@pytest.fixture(scope="session", autouse=True)
def _default_daemon_address_taken():
    """The suite must pass while the README's daemon runs on its default address (a
    newcomer's tour in another shell): every test runs with 127.0.0.1:50051 held, so none can
    come to rely on that well-known port being free. Already taken: the condition holds."""
    holder = socket.socket()
    try:
        holder.bind(DEFAULT_ADDRESS)
        holder.listen(1)
    except OSError:
        holder.close()
        yield
        return
    with holder:
        yield


@pytest.fixture(autouse=True)
def _store_integrity_checked_at_close(monkeypatch):
    """Every Store a test closes is checked first: index, tiers, policies, queues and pins
    must agree (Store.check_integrity) once its copies are done."""
    from kvstore.store import Store

    close = Store.close

    def checked_close(self):
        if not self.index.closed:
            self.flush()
            self.check_integrity()
        close(self)

    monkeypatch.setattr(Store, "close", checked_close)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random llama checkpoint (engine/testing.py), made once a run, for tests of the
    engine's and connector's code paths rather than a model's numerics."""
    from engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run a model: on two shared cores OpenMP spinning across threads
    makes small matmuls 40x slower (use with ``pytestmark = pytest.mark.usefixtures(...)``)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
