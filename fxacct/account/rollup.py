"""The one inclusive roll-up of per-module figures: a module's figure includes its submodules'."""

from __future__ import annotations

from collections.abc import Iterable


def ancestors(fqn: str):
    """'a.b.c' -> 'a.b.c', 'a.b', 'a', '' (a module and every module that contains it)."""
    yield fqn
    while fqn:
        fqn = fqn.rpartition(".")[0]
        yield fqn


def inclusive(pairs: Iterable[tuple[str, tuple]]) -> dict[str, tuple]:
    """(module FQN, figures) pairs -> {module: figures summed over it and its submodules}, for every
    module with a figure and each of its ancestors. ``figures`` is a tuple of addable values
    (ints, floats, Flops), summed position by position."""
    own: dict[str, tuple] = {}  # each module's own figures first: a module has many rows, few ancestors
    for module, figures in pairs:
        have = own.get(module)
        own[module] = figures if have is None else tuple(a + b for a, b in zip(have, figures))
    out: dict[str, tuple] = {}
    for module, figures in own.items():
        for m in ancestors(module):
            have = out.get(m)
            out[m] = figures if have is None else tuple(a + b for a, b in zip(have, figures))
    return out
