"""What the commands of actions (`fairgate jobs`, `fairgate tenants`, `fairgate keys`) share."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable


def chosen_action(args: argparse.Namespace, command: str, actions: Iterable[str]) -> str | None:
    """The action `fairgate COMMAND ACTION` was given; None, after one error line on stderr
    listing `actions`, when none was (the caller exits 2, as argparse does)."""
    action: str | None = getattr(args, "action", None)
    if action is None:
        print(f"fairgate {command}: error: choose an action: {', '.join(actions)}",
              file=sys.stderr)
    return action
