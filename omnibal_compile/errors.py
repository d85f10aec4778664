"""Exceptions raised by omnibal_compile. Each message names the input at fault and what to change."""

from __future__ import annotations

__all__ = [
    "OmnibalError",
    "CaptureError",
    "PlanError",
    "InputError",
    "PassError",
    "SimulationError",
    "LaunchError",
    "TrainingError",
    "MissingBackendError",
]


class OmnibalError(Exception):
    """Base class of every error this library raises on purpose."""


class CaptureError(OmnibalError):
    """The model could not be turned into an FX graph."""


class PlanError(OmnibalError, ValueError):
    """A plan is invalid for the model, or no plan satisfies the request."""


class InputError(OmnibalError, ValueError):
    """An argument given by the user is malformed."""


class PassError(OmnibalError):
    """A pass failed; the message names it and the passes that ran before it."""


class SimulationError(OmnibalError):
    """The operation orders cannot complete (a dependency cycle): a bug in a custom order."""


class LaunchError(OmnibalError):
    """The distributed run failed or timed out; the message carries the end of its output."""


class TrainingError(OmnibalError):
    """Training cannot go on (a non-finite loss or weights); the message names the step and the learning rate."""


class MissingBackendError(OmnibalError, ImportError):
    """A kernel backend was asked for by name but its package is not installed."""
