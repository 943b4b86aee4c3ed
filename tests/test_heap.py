"""fxacct.heap: while a profile traces, what existed before is frozen out of the garbage
collector's scans; afterwards the process's heap is as it was, a caller's own freeze included."""

from __future__ import annotations

import gc

import torch

import fxacct
import fxacct.heap


class Seen(torch.nn.Module):
    """Notes, at each forward, how many objects the collector has frozen and its thresholds."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.frozen: list[int] = []
        self.thresholds: list[tuple] = []

    def forward(self, x):
        self.frozen.append(gc.get_freeze_count())
        self.thresholds.append(gc.get_threshold())
        return self.lin(x)


def test_profile_freezes_the_heap_while_it_traces_and_gives_it_back():
    model = Seen()
    before = gc.get_freeze_count()
    assert before == 0
    fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
    assert model.frozen and min(model.frozen) > 1000  # torch's own objects at least
    assert gc.get_freeze_count() == 0


def test_full_collections_are_rarer_while_tracing_and_the_thresholds_come_back():
    model = Seen()
    old = gc.get_threshold()
    gc.set_threshold(500, 7, 3)  # a caller's own, not the defaults: kept but for the third, x10
    try:
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        assert set(model.thresholds) == {(500, 7, 30)}
        assert gc.get_threshold() == (500, 7, 3)
    finally:
        gc.set_threshold(*old)


def test_a_callers_frozen_heap_stays_frozen():
    model = Seen()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        # fxacct neither froze more (the model's traced objects stay collectable) nor unfroze the caller's
        assert set(model.frozen) == {frozen}
        assert gc.get_freeze_count() == frozen
        assert set(model.thresholds) == {gc.get_threshold()}  # nor changed its collector
    finally:
        gc.unfreeze()


def test_a_nested_profile_leaves_the_heap_to_the_outer_one():
    # fxacct.profile calls profile_module: the inner call neither freezes again nor thaws the outer freeze
    model = Seen()
    with fxacct.heap.frozen_heap():
        frozen, thresholds = gc.get_freeze_count(), gc.get_threshold()
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        assert set(model.frozen) == {frozen} and gc.get_freeze_count() == frozen
        assert set(model.thresholds) == {thresholds} and gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


def test_a_one_command_process_makes_full_collections_rarer_for_good():
    old = gc.get_threshold()
    gc.set_threshold(500, 7, 3)
    try:
        fxacct.heap.rarer_full_collections()
        assert gc.get_threshold() == (500, 7, 30)
    finally:
        gc.set_threshold(*old)
