"""Our top-level packages are the only modules of their names in the environment.

Hugging Face's `kernels` (a dependency of transformers >= 5.25) once shadowed our
`kernels/`: the suite failed with `cannot import name 'CUDAProperties' from 'kernels'` on a
fresh install. Two modules of one name cannot share a process, so a dependency that ships
one of our names must fail here, naming itself, rather than somewhere deep in a kernel test.
"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
OURS = ["kvstore", "tiers", "connector", "engine", "kernels", "bench"]


@pytest.mark.parametrize("name", OURS)
def test_no_other_distribution_ships_our_top_level_name(name):
    shipped_by = importlib.metadata.packages_distributions().get(name, [])
    others = sorted(set(shipped_by) - {"kvstore"})
    assert not others, f"`{name}` is also installed by {others}: it would shadow ours or ours would break it"


def test_import_kernels_from_anywhere_is_ours(tmp_path):
    """As the installed environment resolves it: another directory, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run(
        [sys.executable, "-c", "import kernels, connector.transfer; print(kernels.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == ROOT / "kernels" / "__init__.py"
