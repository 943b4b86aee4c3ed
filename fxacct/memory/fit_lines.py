"""Every storage of a step as a line in the batch, from two traces of the same program.

Two traces of one training step at batches b0 < b1 record the same ops, the same storages, born
and freed at the same ops; only their sizes differ. A storage whose bytes are a line in the batch,
``bytes(B) = c + s·B`` with whole ``c, s ≥ 0`` (an activation of shape [B, T, H]: c = 0; a weight:
s = 0), has ``s = (bytes(b1) - bytes(b0)) / (b1 - b0)``, and the step's Lifetimes at any batch
follow without a trace; so do its op-level peak and what the caching allocator reserves
(fxacct.memory.reserved replays the same births and deaths at those sizes).

Two points cannot tell a line from a curve (a [B, B] mask, or a kernel chosen by size at a batch
neither trace saw), so this is never an answer: fxacct.memory.fit_search uses it to choose which
batch to trace next, and the answer is still proven by traces on both sides of it. Pairs that are
not one program (different ops, storages or lifetimes) or whose sizes are not whole lines give
None, and the search solves from the traced totals as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fxacct.memory.fit_search import MAX_FIT_TRACES, largest_batch
from fxacct.memory.peak import Lifetimes

# batches the search on the lines may ask (a walk each, no trace): the allocator's segments make
# the reserved bytes a staircase with flat steps of thousands of examples (ResNet-18 at 2.3M), which
# the bracket-and-bisection needs more than MAX_FIT_TRACES asks to settle
LINE_EVALUATIONS = 4 * MAX_FIT_TRACES


def _structure(life: Lifetimes) -> tuple:
    """What must be equal for two Lifetimes to be one program at two batches: all but the sizes."""
    return (tuple(c for c, _ in life.resident), tuple(entry[:3] for entry in life.born), life.op_names,
            life.op_phases, life.born_storages, life.resident_storages, life.resident_births, life.first_cublas_ops)


def _line(y0: int, y1: int, b0: int, b1: int) -> tuple[int, int] | None:
    """(c, s) with y = c + s·b through (b0, y0) and (b1, y1), both whole and ≥ 0; else None."""
    slope, rest = divmod(y1 - y0, b1 - b0)
    if rest or slope < 0 or y0 - slope * b0 < 0:
        return None
    return y0 - slope * b0, slope


def lines(low: Lifetimes, high: Lifetimes, low_batch: int, high_batch: int) -> Callable[[int], Lifetimes] | None:
    """batch -> the step's Lifetimes at that batch, every size on its line through the two traces
    (``low`` at ``low_batch`` < ``high_batch``, ``high``); None where they are not one program or a
    size is not a whole line."""
    if low_batch >= high_batch or _structure(low) != _structure(high):
        return None
    resident = [_line(a, b, low_batch, high_batch) for (_, a), (_, b) in zip(low.resident, high.resident)]
    born = [_line(a[3], b[3], low_batch, high_batch) for a, b in zip(low.born, high.born)]
    if None in resident or None in born:
        return None

    def at(batch: int) -> Lifetimes:
        return replace(low, resident=tuple((cat, c + s * batch) for (cat, _), (c, s) in zip(low.resident, resident)),
                       born=tuple((*entry[:3], c + s * batch) for entry, (c, s) in zip(low.born, born)))

    return at


class LineGuess:
    """``fit_search.largest_batch``'s guess from the traces' storages: the answer on the lines
    through the largest traced batch and the smallest one of the same program (a model may build
    its masks differently at large batches), each pair solved once, without a trace.

    ``bytes_on(batch, traced, lifetimes)``: what a trace at ``batch`` would give, from the step's
    ``lifetimes`` at that batch, the trace at batch ``traced`` standing for the rest (the graph's
    FSDP2 streams: one program, the same storages)."""

    def __init__(self, bytes_on: Callable[[int, int, Lifetimes], int], capacity: int):
        self.bytes_on, self.capacity = bytes_on, capacity
        self.traced: dict[int, Lifetimes] = {}
        self.answers: dict[tuple[int, int], int | None] = {}

    def add(self, batch: int, life: Lifetimes) -> None:
        self.traced[batch] = life

    def __call__(self, traced: dict[int, int]) -> int | None:
        kept = sorted(b for b in traced if b in self.traced)  # batches whose storages were kept
        for high in reversed(kept):
            for low in (b for b in kept if b < high):
                if (low, high) not in self.answers:
                    self.answers[(low, high)] = self._solve(low, high, traced[low])
                found = self.answers[(low, high)]
                if found is not None and not self._refuted(found, traced):
                    return found
        return None

    def _solve(self, low: int, high: int, low_bytes: int) -> int | None:
        """The largest batch that fits on the lines through ``low`` and ``high``, proven on them
        (B fits, B + 1 does not); None where they are not one program or nothing is proven."""
        at = lines(self.traced[low], self.traced[high], low, high)
        if at is None:
            return None
        found, proven, _ = largest_batch(lambda b: self.bytes_on(b, high, at(b)), low, low_bytes, self.capacity,
                                         max_traces=LINE_EVALUATIONS)
        return found if proven else None

    def _refuted(self, found: int, traced: dict[int, int]) -> bool:
        """A trace disagrees with the lines: the program differs at that batch."""
        return (traced.get(found, 0) > self.capacity
                or traced.get(found + 1, self.capacity + 1) <= self.capacity)


__all__ = ["lines", "LineGuess", "LINE_EVALUATIONS"]
