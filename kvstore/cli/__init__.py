"""The ``kvstore`` command (serve, stats, ping, config, fsck, cluster: commands.py) and fsck's
offline check of a data directory (fsck.py). Nothing here loads torch until a command that
reads blobs runs."""

from kvstore.cli.commands import main

__all__ = ["main"]
