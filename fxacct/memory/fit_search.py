"""The largest batch whose step fits a GPU, found from traces and proven by them, never extrapolated.

``bytes_at(B)`` is what a step at batch B needs on the device (one trace each; the caller decides
which quantity that is). Both searches here assume it never falls as the batch grows, and answer
the B at which it crosses the capacity: B fits, B + 1 does not.

The bytes of a step are affine in the batch for many models (weights, gradients and optimizer state
stay, activations grow as B), but in general they are the largest, over the step's instants, of
affine functions of B: convex and piecewise affine. The instant that peaks at batch 2 (the optimizer
step, say) is not the one that peaks at batch 4000 (the backward), so a line through two small
batches misjudges the slope. An allocator's rounding adds steps. So ``largest_batch`` solves, then
proves, then falls back:

1. solve: the line through the two traced batches whose bytes lie nearest the capacity, solved
   exactly (``Fraction``) for the largest batch under the capacity; the batch it names is traced
   and the line drawn again. On a piecewise-affine function the solve is exact once both points lie
   on the piece that crosses the capacity (an affine step needs the traces at B and 2B only).
   A caller that kept the traces' storages passes a ``guess`` first: each storage on its own line
   (fxacct.memory.fit_lines) sees the instant that peaks at batch 4000 from traces at 2 and 4, and
   the allocator's steps too, where the totals' line cannot.
2. proof: a traced B that fits beside a traced B + 1 that does not.
3. fallback, when no proof came within ``SOLVE_TRACES``: the bracket-and-bisection search
   (``bracket_search``, the search fxacct ran before this one), replayed in full over the traces
   already made, so its answer is the one it always gave.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

MAX_FIT_TRACES = 24  # traces the bracket-and-bisection search spends at most
SOLVE_TRACES = 6  # traces the solve spends before it hands over to bracket_search
# doublings of the batch tried for growth when the bytes at 2B equal those at B: what the CUDA
# caching allocator reserves grows by whole segments and pages (2 MiB, 20 MiB: fxacct.memory.allocator),
# so a small model's reserved bytes can stay flat over a few doublings of a small batch
FLAT_DOUBLINGS = 4


class Probe:
    """``bytes_at`` called at most once per batch: each call is a trace."""

    def __init__(self, bytes_at: Callable[[int], int], capacity: int, known: dict[int, int]):
        self.bytes_at, self.capacity, self.traced = bytes_at, capacity, dict(known)
        self.calls = 0  # traces made here (the batches in ``known`` cost none)

    def __call__(self, batch: int) -> int:
        if batch not in self.traced:
            self.traced[batch] = self.bytes_at(batch)
            self.calls += 1
        return self.traced[batch]

    def fits(self, batch: int) -> bool:
        return self(batch) <= self.capacity


def largest_batch(bytes_at: Callable[[int], int], batch: int, batch_bytes: int, capacity: int,
                  max_traces: int = MAX_FIT_TRACES,
                  guess: Callable[[dict[int, int]], int | None] | None = None) -> tuple[int | None, bool, Probe]:
    """(the largest batch that fits, whether traces prove it, the probe with every trace made);
    ``batch_bytes`` = bytes_at(batch), already traced. (None, False) where the bytes do not grow
    from ``batch`` to ``2 * batch``: no batch is searched. ``guess(traced)``, asked before each
    solve (None: no guess), names the answer it expects (fxacct.memory.fit_lines: each storage on
    its own line); the next trace is that batch, or the one beside it that would prove it, and the
    line through the traced totals is drawn only where the guess is None or already traced. A
    guess chooses traces and proves nothing."""
    probe = Probe(bytes_at, capacity, {batch: batch_bytes})
    second = 2 * batch
    while probe(second) <= batch_bytes:  # flat: a staircase's step, or bytes that do not grow at all
        if second >= batch * 2**FLAT_DOUBLINGS or not probe.fits(second):
            return None, False, probe
        second *= 2
    for solves in range(SOLVE_TRACES + 1):
        lo, hi = _bracket(probe)
        if hi is not None and lo >= hi:
            break  # the bytes fell as the batch grew: only the bisection's own answer is safe
        if hi == lo + 1:
            return lo, True, probe  # lo fits (or lo is 0) and lo + 1 does not, both traced
        nxt = _next(guess(dict(probe.traced)), lo, hi) if guess is not None else None
        if nxt is None or nxt in probe.traced:  # no guess, or one the traces already answered
            nxt = _next(_solve(probe.traced, capacity), lo, hi) if solves < SOLVE_TRACES else None
        if nxt is None or nxt in probe.traced:
            break
        probe(nxt)
    found, verified = bracket_search(probe, batch, batch_bytes, capacity, max_traces, second)
    return found, verified, probe


def _next(solved: int | None, lo: int, hi: int | None) -> int | None:
    """The batch to trace for a solved answer, kept inside the bracket (lo fits, hi does not): the
    answer itself, or lo + 1 where it is lo (known to fit: the question is lo + 1)."""
    if solved is None:
        return None
    solved = max(solved, lo) if hi is None else min(max(solved, lo), hi - 1)
    return solved + 1 if solved == lo else solved


def _bracket(probe: Probe) -> tuple[int, int | None]:
    """(the largest traced batch that fits, 0 if none; the smallest that does not, None if none)."""
    fit = [b for b, n in probe.traced.items() if n <= probe.capacity]
    over = [b for b, n in probe.traced.items() if n > probe.capacity]
    return max(fit, default=0), min(over, default=None)


def _solve(traced: dict[int, int], capacity: int) -> int | None:
    """The largest B under the line through the traced point nearest the capacity and the nearest
    one of other bytes (a staircase's flat pair draws no line):
    bytes(B) = y0 + (B - b0)·s with s = (y1 - y0) / (b1 - b0), so B = b0 + ⌊(capacity - y0) / s⌋."""
    near = sorted(traced.items(), key=lambda kv: (abs(kv[1] - capacity), kv[0]))
    (b0, y0) = near[0]
    other = [(b, y) for b, y in near[1:] if y != y0]
    if not other:
        return None
    (b1, y1) = other[0]
    slope = Fraction(y1 - y0, b1 - b0)
    if slope <= 0:
        return None
    return b0 + (capacity - y0) // slope


def bracket_search(probe: Callable[[int], int], batch: int, batch_bytes: int, capacity: int,
                   max_traces: int = MAX_FIT_TRACES, second: int | None = None) -> tuple[int | None, bool]:
    """The search before ``largest_batch``, step for step: a first guess from the line through
    ``batch`` and ``second`` (``2 * batch``; a larger batch where the bytes stayed flat), then a bracket (a batch that fits, the next one that does not) grown
    by doubling steps and settled by bisection, at most ``max_traces`` batches asked (``batch``
    counted). It asks ``probe`` the same batches whatever ``probe`` has traced before."""
    asked = {batch: batch_bytes}

    def fits(b: int) -> bool:
        if b not in asked:
            asked[b] = probe(b)
        return asked[b] <= capacity

    second = second or 2 * batch
    fits(second)
    slope = (asked[second] - batch_bytes) / (second - batch)
    if slope <= 0:
        return None, False
    guess = max(1, int((capacity - (batch_bytes - slope * batch)) // slope))
    lo, hi = (guess, None) if fits(guess) else (0, guess)
    step = 1
    while hi is None and len(asked) < max_traces:  # grow until a batch does not fit
        if fits(lo + step):
            lo, step = lo + step, step * 2
        else:
            hi = lo + step
    while lo > 0 and not fits(lo) and len(asked) < max_traces:
        lo //= 2
    if hi is None:
        hi = lo + 1
    while hi - lo > 1 and len(asked) < max_traces:  # bisect: lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi - lo == 1 and (lo == 0 or fits(lo)) and not fits(hi)


__all__ = ["MAX_FIT_TRACES", "SOLVE_TRACES", "Probe", "largest_batch", "bracket_search"]
