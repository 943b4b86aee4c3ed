"""``--expert-load FILE``: a measured routing histogram for expert parallelism, instead of the
balanced routing fxacct assumes (fake tensors carry no router decisions).

The file is JSON, the tokens routed to each expert (counts or fractions, any scale), either one
histogram for every MoE layer or one per MoE layer in the model's order::

    {"experts": [812, 790, 1033, ...]}
    {"layers": [[812, 790, ...], [640, 901, ...], ...]}

How it is used (fxacct.load.torchtitan): expert-parallel rank r holds experts
[r·E/ep, (r+1)·E/ep) (torchtitan's expert placement, ``Shard(0)`` of the experts); every rank is
taken to route its tokens as the histogram says, so rank r receives from each rank the share of
that rank's routed rows its own experts get. The account is of the busiest rank (the one whose
experts receive the most rows over all layers): its experts are rotated onto rank 0, the rank
fxacct traces, which changes nothing else (every rank holds the same shapes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from fxacct.errors import UsageError

FORMAT = '{"experts": [tokens per expert, ...]} or {"layers": [[...], ...]} (one list per MoE layer)'


@dataclass(frozen=True)
class ExpertLoad:
    path: str
    layers: tuple[tuple[float, ...], ...]  # per MoE layer; one entry: the same for every layer

    def of_layer(self, index: int) -> tuple[float, ...]:
        return self.layers[0] if len(self.layers) == 1 else self.layers[index]


def read(path: str) -> ExpertLoad:
    """The histogram in ``path``, checked (a one-line usage error naming the problem otherwise)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UsageError(f"--expert-load {path}: cannot read it ({e.strerror}); give a JSON file {FORMAT}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--expert-load {path}: not JSON ({e.msg}, line {e.lineno}); give {FORMAT}") from None
    if isinstance(doc, dict) and isinstance(doc.get("experts"), list):
        layers = [doc["experts"]]
    elif isinstance(doc, dict) and isinstance(doc.get("layers"), list) and doc["layers"]:
        layers = doc["layers"]
    else:
        raise UsageError(f"--expert-load {path}: expected {FORMAT}")
    for i, hist in enumerate(layers):
        where = "" if len(layers) == 1 else f" (layer {i})"
        if not isinstance(hist, list) or not hist or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0 for c in hist):
            raise UsageError(f"--expert-load {path}{where}: each histogram is a list of token counts, finite and >= 0")
        if sum(hist) <= 0:
            raise UsageError(f"--expert-load {path}{where}: the histogram routes no tokens (all counts are 0)")
    return ExpertLoad(path, tuple(tuple(float(c) for c in h) for h in layers))


def check(load: ExpertLoad, experts: int, moe_layers: int | None = None) -> None:
    """Each histogram has one count per expert; per-layer histograms one per MoE layer."""
    for i, hist in enumerate(load.layers):
        if len(hist) != experts:
            where = "" if len(load.layers) == 1 else f" layer {i}:"
            raise UsageError(f"--expert-load {load.path}:{where} {len(hist)} counts, but the model has {experts} "
                             "experts; give one count per expert")
    if moe_layers is not None and len(load.layers) not in (1, moe_layers):
        raise UsageError(f"--expert-load {load.path}: {len(load.layers)} histograms, but the model has {moe_layers} "
                         "MoE layers; give one per MoE layer, or one for all ({\"experts\": [...]})")


def rank_shares(hist: tuple[float, ...], ep: int) -> list[float]:
    """The share of the routed rows each expert-parallel rank's experts receive."""
    per = len(hist) // ep
    total = sum(hist)
    return [sum(hist[r * per:(r + 1) * per]) / total for r in range(ep)]


def busiest_rank(load: ExpertLoad, ep: int) -> int:
    """The expert-parallel rank whose experts receive the most rows over all layers (the lowest on a tie)."""
    totals = [0.0] * ep
    for hist in load.layers:
        for r, s in enumerate(rank_shares(hist, ep)):
            totals[r] += s
    return max(range(ep), key=lambda r: (totals[r], -r))


def rotated(hist: tuple[float, ...], rank: int, ep: int) -> tuple[float, ...]:
    """``hist`` with rank ``rank``'s experts first: rank 0, the rank traced, then holds them."""
    shift = rank * (len(hist) // ep)
    return hist[shift:] + hist[:shift]


def apportion(rows: int, shares: list[float]) -> list[int]:
    """``rows`` split in whole rows by ``shares`` (largest remainder; ties to the lower rank)."""
    exact = [rows * s for s in shares]
    out = [math.floor(x) for x in exact]
    left = rows - sum(out)
    for r in sorted(range(len(shares)), key=lambda r: (-(exact[r] - out[r]), r))[:left]:
        out[r] += 1
    return out


class Routing:
    """How the traced rank splits its routed rows among the expert-parallel ranks, per MoE layer:
    balanced (``load`` None: an equal share to every rank, the remainder of an uneven split to the
    first ranks), or by ``load`` as the busiest rank (module docstring). A layer is known by its
    token dispatcher, numbered in the order the forward first calls them (the model's layer order)."""

    def __init__(self, load: ExpertLoad | None = None):
        self.load = load
        self._layers: dict[int, int] = {}

    def splits(self, dispatcher, rows: int, ep: int) -> tuple[list[int], list[int]]:
        """(rows sent to each of the ``ep`` ranks, rows received from each) in one layer."""
        if self.load is None:
            send = [rows // ep + (1 if r < rows % ep else 0) for r in range(ep)]
            return send, list(send)
        layer = self._layers.setdefault(id(dispatcher), len(self._layers))
        if len(self.load.layers) > 1 and layer >= len(self.load.layers):
            raise UsageError(f"--expert-load {self.load.path}: {len(self.load.layers)} histograms, but the model routes "
                             f"through more MoE layers; give one per MoE layer")
        hist = rotated(self.load.of_layer(layer), busiest_rank(self.load, ep), ep)
        send = apportion(rows, rank_shares(hist, ep))
        return send, [send[0]] * ep  # every rank routes as many rows alike: each sends rank 0 its share

    def note(self, ep: int) -> str:
        """What the report says of the routing under ``ep`` expert-parallel ranks."""
        if self.load is None:
            return (f"expert parallelism (ep={ep}): routing assumed balanced, every rank's experts receiving "
                    f"1/{ep} of the routed tokens; give a measured histogram with --expert-load FILE")
        rank = busiest_rank(self.load, ep)
        share = sum(rank_shares(h, ep)[rank] for h in self.load.layers) / len(self.load.layers)
        return (f"expert parallelism (ep={ep}): routing from --expert-load {self.load.path}; the busiest "
                f"expert-parallel rank ({rank}, whose experts receive {share:.1%} of the routed tokens where "
                f"balanced routing gives {1 / ep:.1%}) is the one accounted")


__all__ = ["ExpertLoad", "Routing", "read", "check", "rank_shares", "busiest_rank", "rotated", "apportion", "FORMAT"]
