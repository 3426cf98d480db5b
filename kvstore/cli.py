"""The ``kvstore`` command: operate a store's data on this host.

Errors a user can cause print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvstore.config import ConfigError, StoreConfig, load_config
from kvstore.fsck import fsck


def _load(args) -> StoreConfig:
    cfg = load_config(args.config) if args.config else StoreConfig()
    if getattr(args, "data_dir", None):
        cfg.disk.path = args.data_dir
    return cfg


def cmd_config(args) -> int:
    """Print the effective configuration (defaults merged with the file)."""
    cfg = _load(args)

    def emit(obj, prefix=""):
        scalars = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not dataclasses.is_dataclass(getattr(obj, f.name))}
        for name, value in scalars.items():
            print(f"# {name} is unset" if value is None else f"{name} = {_toml(value)}")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                print(f"\n[{prefix}{f.name}]")
                emit(value, f"{prefix}{f.name}.")

    emit(cfg)
    return 0


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def cmd_fsck(args) -> int:
    """Verify every blob in the disk tier's directory; exit 1 if anything is bad."""
    cfg = _load(args)
    report = fsck(cfg.disk.path, repair=args.repair)
    print(f"{cfg.disk.path}: {report.blobs} blobs, {report.bytes} bytes, "
          f"{len(report.corrupt)} corrupt, {len(report.temporary)} temporary files")
    for path, reason in report.corrupt:
        print(f"corrupt: {path}: {reason}")
    if args.repair:
        print(f"removed {report.removed} files")
    return 1 if (report.corrupt or report.temporary) and not args.repair else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Multi-tier KV-cache store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("config", help="print the effective configuration")
    p.add_argument("--config", help="TOML configuration file")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("fsck", help="verify every blob in the disk tier")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--data-dir", help="disk tier directory (overrides the configuration)")
    p.add_argument("--repair", action="store_true", help="delete corrupt and temporary files")
    p.set_defaults(func=cmd_fsck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, PermissionError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
