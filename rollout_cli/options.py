"""What every `rollout` command module shares: the default store and the one-line usage error (main.py and
runs.py both need them; here neither imports the other)."""

from __future__ import annotations

import sys

import click


def default_store_url() -> str:
    from rollout_lib.paths import default_store

    return str(default_store())


# A command's --store: by default the store of rollout's home, where `rollout train` writes unless told otherwise.
STORE_OPTION_DEFAULT = dict(default=default_store_url, show_default="the home's store, .rollout/store")


class UsageLine(click.UsageError):
    """A usage error shown as one line (`rollout: error: ...`), not click's usage block."""

    def show(self, file=None) -> None:
        print(f"rollout: error: {self.format_message()}", file=sys.stderr)
