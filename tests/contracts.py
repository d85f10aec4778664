"""Checks shared by the test files: the project's rules for its typed records."""

from __future__ import annotations

import dataclasses

import pytest


def assert_frozen_keyword_only(instance: object) -> None:
    """``instance``'s dataclass refuses assignment and positional construction (frozen, keyword-only)."""
    cls = type(instance)
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(instance, first, getattr(instance, first))
    values = [getattr(instance, f.name) for f in dataclasses.fields(cls) if f.init]
    with pytest.raises(TypeError, match="positional"):
        cls(*values)
