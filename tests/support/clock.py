"""An injected wall clock for stores and policies that take ``clock=``."""

from __future__ import annotations


class Clock:
    """Injected wall clock (seconds): ``t`` is set by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
