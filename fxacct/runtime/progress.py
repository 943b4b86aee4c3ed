"""Progress of a runtime run on stderr: a bar on a terminal, one line per phase otherwise.

The run reports ``(phase, done, total)``: ``done == 0`` when a phase begins, then after each of its
``total`` units. On a terminal the line is redrawn in place (``\\r``) and ended when the run is over; in
a log or a pipe, each phase prints one line once its first unit is done (``fxacct runtime: timed 10
steps``), so every line says what it counts, and a model that fails in its first step leaves only
the one-line error on stderr. Third-party lines are silenced where they start
(fxacct.trace.torch_private.quiet_kineto), not here.
"""

from __future__ import annotations

import sys
from typing import TextIO

PREFIX = "fxacct runtime"
WIDTH = 24  # characters of the bar


def _units(n: int, unit: str) -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


class Progress:
    """A callable ``progress(phase, done, total)`` writing to ``stream`` (default: sys.stderr)."""

    def __init__(self, stream: TextIO | None = None, unit: str = "step"):
        self.stream = stream if stream is not None else sys.stderr
        self.unit = unit
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.drawn = False  # a bar line is on screen, not yet ended

    def __call__(self, phase: str, done: int, total: int) -> None:
        if total <= 0:
            return
        if self.tty:
            self._draw(phase, done, total)
        elif done == 1:
            self.stream.write(f"{PREFIX}: {phase} {_units(total, self.unit)}\n")
            self.stream.flush()

    def _draw(self, phase: str, done: int, total: int) -> None:
        filled = WIDTH * done // total if total else WIDTH
        bar = "#" * filled + "-" * (WIDTH - filled)
        self.stream.write(f"\r{PREFIX}: {phase:<14} [{bar}] {done}/{_units(total, self.unit)}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """End the bar's line (a terminal); nothing otherwise."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Progress", "PREFIX"]
