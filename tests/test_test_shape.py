"""The test suite's own shape: test modules share set-up only through helper modules and
conftest fixtures, never by importing each other (pytest would collect an imported test
function a second time, and a change to one test file would quietly change another's), and
the suite has one default namespace ``NS``: other namespaces carry names that say why. Tests
live in a folder per wing (tests/store/, tests/daemon/, ...); only tests of the whole product
(the README, the command lines, the store contract both sides keep) sit at the top."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def is_test_module(name: str) -> bool:
    return name.split(".")[-1].startswith("test_")


def imported_modules(tree: ast.Module) -> list[str]:
    """Every module an import statement names, at any depth (imports inside functions too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.append(base)
            names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
    return names


def defines_ns(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "NS" for t in targets):
            return True
    return False


def modules():
    return {str(path.relative_to(TESTS)): ast.parse(path.read_text(), str(path)) for path in sorted(TESTS.rglob("*.py"))}


def test_no_test_module_imports_another():
    found = [f"{name} imports {module}" for name, tree in modules().items()
             for module in imported_modules(tree) if module and is_test_module(module)]
    assert not found, "test modules importing test modules: " + "; ".join(found)


def test_one_module_defines_ns():
    defining = [name for name, tree in modules().items() if defines_ns(tree)]
    assert len(defining) <= 1, f"NS is defined in {len(defining)} modules: {', '.join(defining)}"


# tests of the whole product rather than of one wing
TOP_LEVEL = {"test_api_conformance.py", "test_blob.py", "test_cli_errors.py", "test_config.py", "test_fsck_live.py",
             "test_interrupt.py", "test_keys.py", "test_kvstore_cli.py", "test_readme.py", "test_readme_commands.py",
             "test_test_shape.py", "test_wings.py"}


def test_test_modules_live_in_their_wings_folder():
    stray = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in TOP_LEVEL)
    assert not stray, f"test modules outside a wing's folder (tests/<wing>/): {', '.join(stray)}"
