"""Scheduling classes and fair-share weights: the vocabulary tenants, admission, routing and workers share."""

from __future__ import annotations

from enum import IntEnum

MAX_WEIGHT = 1000.0  # `gen.weight`: fair-share weight in (0, MAX_WEIGHT]


class Priority(IntEnum):
    """Scheduling class: an int on the wire, its lower-case name to operators, tenants and metrics."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Priority:
        """'interactive' or 'batch' (exactly) -> Priority; ValueError otherwise."""
        for member in cls:
            if name == member.label:
                return member
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_NAMES)}, got {name!r}")


PRIORITY_NAMES = tuple(p.label for p in Priority)
