"""Imports point one way between the wings (docs/architecture.md): checked on the source with
``ast``, so a new module is covered without being listed, and an import inside a function
counts as much as one at the top."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# wing (a folder) -> the packages none of its modules may import
FORBIDDEN = {
    "tiers": ("kvstore.store", "kvstore.cluster", "kvstore.daemon", "kvstore.client", "connector", "engine", "bench"),
    "kvstore/cluster": ("kvstore.store", "kvstore.daemon", "kvstore.client", "connector", "engine", "bench"),
    "kvstore/store": ("kvstore.daemon", "kvstore.client", "connector", "engine", "bench"),
    "kvstore/client": ("kvstore.store", "kvstore.cluster", "kvstore.daemon", "connector", "engine", "bench"),
    "kvstore/wire": ("kvstore.store", "kvstore.cluster", "kvstore.daemon", "kvstore.client", "connector", "engine",
                     "bench"),
    "kvstore/daemon": ("kvstore.client", "connector", "engine", "bench"),
    "connector": ("engine", "bench"),
}


def imports(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return sorted(found)


def crossings(wing: str) -> list[str]:
    banned = FORBIDDEN[wing]
    out = []
    for path in sorted((ROOT / wing).rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for line, module in imports(path.read_text()):
            if any(module == b or module.startswith(b + ".") for b in banned):
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    return out


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_imports_point_one_way(wing):
    assert (ROOT / wing).is_dir(), wing
    assert crossings(wing) == []


def test_the_check_sees_a_crossing_inside_a_function():
    source = "def f():\n    from kvstore.store.facade import Store\nimport kvstore.wire.stats\n"
    assert imports(source) == [(2, "kvstore.store.facade"), (3, "kvstore.wire.stats")]
