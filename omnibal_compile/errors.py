"""Exceptions raised by omnibal_compile. Each message names the input at fault and what to change."""

from __future__ import annotations

__all__ = ["OmnibalError", "CaptureError", "PlanError", "InputError"]


class OmnibalError(Exception):
    """Base class of every error this library raises on purpose."""


class CaptureError(OmnibalError):
    """The model could not be turned into an FX graph."""


class PlanError(OmnibalError, ValueError):
    """A plan is invalid for the model, or no plan satisfies the request."""


class InputError(OmnibalError, ValueError):
    """An argument given by the user is malformed."""
