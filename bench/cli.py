"""The ``kvbench`` command: every module in ``bench/`` that defines ``add_parser`` is a subcommand.

A subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed args; returns an exit code or None).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pkgutil
import re
import signal
import sys
import threading

import bench
from kvstore.cli.commands import parse_args, version
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


class Interrupt:
    """Ctrl-C ends a run within a second, in one line and exit code 130, never a traceback.

    The first SIGINT raises KeyboardInterrupt in the main thread, so that the run's ``finally``
    blocks stop its engines and daemons and remove its files; whatever they have not done
    within ``grace_s`` (a process still starting, a daemon flushing) is cut short: every child
    process gets SIGTERM (a daemon then shuts down cleanly on its own) and this process exits
    at once, without the interpreter's teardown (a second with torch loaded, and a wait for
    every worker thread). A second Ctrl-C does that at once."""

    def __init__(self, command: str, grace_s: float = 0.5) -> None:
        self.command, self.grace_s = command, grace_s
        self._interrupted = False
        self._exiting = threading.Lock()

    def install(self):
        """Handle SIGINT; returns the handler it replaces."""
        return signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if self._interrupted:
            self.exit()
        self._interrupted = True
        threading.Timer(self.grace_s, self.exit).start()
        raise KeyboardInterrupt

    def exit(self) -> None:
        self._exiting.acquire()  # once: the timer's thread and the main thread may both get here
        print(f"kvbench {self.command}: interrupted", file=sys.stderr, flush=True)
        for pid in _child_processes():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        sys.stdout.flush()
        os._exit(130)


def _child_processes() -> list[int]:
    """The processes this one started, from any of its threads (Linux's /proc)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return pids


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(build_parser(next((a for a in argv if not a.startswith("-")), None)), argv)
    interrupt = Interrupt(args.command)
    # a signal handler can only be set in the main thread; a caller's (a test runner's) is put back
    previous = interrupt.install() if threading.current_thread() is threading.main_thread() else None
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        interrupt.exit()
    except (UsageError, FileNotFoundError, PermissionError, ValueError, TierUnavailable, DaemonError) as exc:
        print(f"kvbench {args.command}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # transformers, for the comparisons: a test extra
        print(f"kvbench {args.command}: {exc}; it comes with the test install: bash scripts/setup.sh test",
              file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
