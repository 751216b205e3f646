"""Switchyard's tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root, wherever a test module sits
