"""The priority classes a request can ask for, in the order they run."""

from __future__ import annotations

PRIORITIES = ("interactive", "batch")
PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
