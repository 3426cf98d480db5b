"""The ``kvbench`` command: every module in ``bench/`` that defines ``add_parser`` is a subcommand.

A subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed args; returns an exit code or None).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import re
import sys

import bench
from kvstore.cli import parse_args, version
from kvstore.client.errors import DaemonError
from tiers.base import TierUnavailable


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit code 2 (so is a
    tier that cannot be used, e.g. a data directory another process holds)."""


def _subcommand_modules(only: str | None = None):
    """The modules whose source defines ``add_parser``, each imported; the others are not: a
    helper such as probe_model needs torch at its top, seconds of start-up for ``--help``."""
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda i: i.name):
        if info.name in ("cli", "__main__") or info.name.startswith("_") or only not in (None, info.name):
            continue
        name = f"bench.{info.name}"
        source = importlib.util.find_spec(name).loader.get_source(name)
        if re.search(r"^def add_parser\(", source, re.M):
            yield importlib.import_module(name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All subcommands; with ``command``, only that one when it names one (its module alone is
    imported)."""
    parser = argparse.ArgumentParser(prog="kvbench", description="Benchmarks for the KV-cache store.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _subcommand_modules(command and command.replace("-", "_")):
        module.add_parser(sub)
    if command is not None and command not in sub.choices:  # a typo: its error lists every command
        return build_parser()
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(build_parser(next((a for a in argv if not a.startswith("-")), None)), argv)
    try:
        return args.func(args) or 0
    except (UsageError, FileNotFoundError, PermissionError, ValueError, TierUnavailable, DaemonError) as exc:
        print(f"kvbench {args.command}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # transformers, for the comparisons: a test extra
        print(f"kvbench {args.command}: {exc}; it comes with the test install: bash scripts/setup.sh test",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
