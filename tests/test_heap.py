"""fxacct.heap: while a profile traces, what existed before is frozen out of the garbage
collector's scans; afterwards the process's heap is as it was, a caller's own freeze included."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.fx as fx
from helpers import target

import fxacct
import fxacct.heap
import fxacct.tools.plan_probe as plan_probe
from fxacct.tools.plan import plan


class Seen(torch.nn.Module):
    """Notes, at each forward, how many objects the collector has frozen and its thresholds."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.frozen: list[int] = []
        self.thresholds: list[tuple] = []
        self.collecting: list[bool] = []
        self.graphs: list[int] = []  # FX graphs alive (the collector's young objects) at each forward

    def forward(self, x):
        self.frozen.append(gc.get_freeze_count())
        self.thresholds.append(gc.get_threshold())
        self.collecting.append(gc.isenabled())
        self.graphs.append(sum(type(o) is fx.Graph for o in gc.get_objects()))
        return self.lin(x)


def test_profile_freezes_the_heap_while_it_traces_and_gives_it_back():
    model = Seen()
    before = gc.get_freeze_count()
    assert before == 0
    fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
    assert model.frozen and min(model.frozen) > 1000  # torch's own objects at least
    assert gc.get_freeze_count() == 0


def test_the_collector_is_off_while_tracing_and_comes_back_as_it_was():
    model = Seen()
    old = gc.get_threshold()
    gc.set_threshold(500, 7, 3)  # a caller's own, not the defaults: left as they are
    try:
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        assert model.collecting == [False, False]  # the training forward and the inference one
        assert set(model.thresholds) == {(500, 7, 3)}
        assert gc.isenabled() and gc.get_threshold() == (500, 7, 3)
    finally:
        gc.set_threshold(*old)


def test_a_caller_who_switched_the_collector_off_keeps_it_off():
    gc.disable()
    try:
        fxacct.profile_module(Seen(), (torch.empty(2, 4, device="meta"),))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_largest_batch_search_frees_each_probes_graph():
    # with the collector off, each probe's dropped FX graph (cyclic garbage) would still be alive
    # at the next probe's forward: 1, 2, 3, ... graphs; collect_dropped frees it after each probe
    model = Seen()
    fxacct.profile_module(model, (torch.empty(2, 4),), config=fxacct.Config(batch=2, gpu="h100"),
                          inputs_for=lambda b: ((torch.empty(b, 4),), {}))
    probes = model.graphs[2:]  # after the profile's own training and inference captures
    assert len(probes) >= 3, model.graphs
    assert max(probes) <= min(probes) + 1, model.graphs  # the probe before it at most, never piling up
    assert not any(model.collecting)


def test_the_search_freezes_the_profiles_own_objects_before_its_probes():
    # each probe's collection walks what was made since the previous one, not the profile's captures again
    model = Seen()
    fxacct.profile_module(model, (torch.empty(2, 4),), config=fxacct.Config(batch=2, gpu="h100"),
                          inputs_for=lambda b: ((torch.empty(b, 4),), {}))
    own, probes = model.frozen[:2], model.frozen[2:]  # the training and inference captures, then the probes
    assert probes and min(probes) > max(own), model.frozen
    assert gc.get_freeze_count() == 0


def _graphs() -> int:
    return sum(type(o) is fx.Graph for o in gc.get_objects())


@pytest.fixture(params=[False, True], ids=["library", "one command"])
def one_command(request):
    """A library caller's process, or a one-command one (the CLI's: collector off for good)."""
    if request.param:
        request.getfixturevalue("one_command_process")
    return request.param


@pytest.mark.parametrize("search", [False, True], ids=["profile", "largest batch"])
def test_a_loop_of_profiles_keeps_none_it_dropped(search, one_command):
    # without a collection on the way in, each call's freeze() kept the results dropped since the last
    # one (and, after a search, its frozen inference graph) from all but a full collection: six profiles
    # left six to twelve FX graphs alive. A one-command process (the CLI; `fxacct diff` profiles twice)
    # has its collector off: the way in collects all the same
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    config = fxacct.Config(batch=2, gpu="h100" if search else None)
    fxacct.profile_module(model, (torch.empty(2, 4),), config=config, inputs_for=lambda b: ((torch.empty(b, 4),), {}))
    gc.collect()
    before = _graphs()
    for _ in range(6):
        fxacct.profile_module(model, (torch.empty(2, 4),), config=config,
                              inputs_for=lambda b: ((torch.empty(b, 4),), {}))
    after = _graphs()
    assert after - before <= 2, (before, after)  # the last call's: its result and its inference graph


def test_a_callers_frozen_heap_stays_frozen(monkeypatch):
    # spied, not counted: a frozen object that reference counting frees lowers gc.get_freeze_count()
    # with no unfreeze (the suite's earlier tests leave such objects behind)
    calls = []
    model = Seen()
    gc.freeze()
    try:
        for name in ("freeze", "unfreeze"):
            monkeypatch.setattr(gc, name, lambda name=name, real=getattr(gc, name): (calls.append(name), real())[1])
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        # fxacct neither froze more (the model's traced objects stay collectable) nor unfroze the caller's
        assert calls == [] and len(model.frozen) == 2 and min(model.frozen) > 1000
        assert set(model.thresholds) == {gc.get_threshold()}  # nor changed its collector
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_a_nested_profile_leaves_the_heap_to_the_outer_one(monkeypatch):
    # fxacct.profile calls profile_module: the inner call neither freezes again nor thaws the outer
    # freeze. Spied, not counted, as above: a frozen object freed by reference counting during the
    # inner call lowers gc.get_freeze_count() (a full CI run's order once left such objects: 1 failure)
    calls = []
    model = Seen()
    with fxacct.heap.frozen_heap():
        thresholds = gc.get_threshold()
        for name in ("freeze", "unfreeze"):
            monkeypatch.setattr(gc, name, lambda name=name, real=getattr(gc, name): (calls.append(name), real())[1])
        fxacct.profile_module(model, (torch.empty(2, 4, device="meta"),))
        monkeypatch.undo()
        assert calls == [] and len(model.frozen) == 2 and min(model.frozen) > 1000
        assert set(model.thresholds) == {thresholds} and gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


def test_a_one_command_process_switches_the_collector_off_for_good(one_command_process):
    fxacct.profile_module(Seen(), (torch.empty(2, 4, device="meta"),))
    assert not gc.isenabled()


def test_a_one_command_process_leaves_a_calls_garbage_to_the_exit(one_command):
    # the inference capture's graph is cyclic garbage once the call returns: a library call's young
    # collection frees it at the first allocations after; a one-command process (the CLI, which then
    # leaves by os._exit) collects nothing more
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    gc.collect()
    before = _graphs()
    prof = fxacct.profile_module(model, (torch.empty(2, 4),))
    churn = [[i] for i in range(20 * gc.get_threshold()[0])]  # enough allocations for young collections
    alive = _graphs() - before
    assert alive == (2 if one_command else 1), alive  # the result's graph, and the inference capture's
    assert gc.get_freeze_count() == 0
    del churn
    gc.collect()
    assert _graphs() - before == 1 and prof.capture.graph is not None  # a full collection frees it


def test_a_plan_frees_each_layouts_graphs(monkeypatch):
    # each layout's trace is dropped once its numbers are kept: FX graphs alive after each must not pile up
    alive = []
    collect = plan_probe.collect_dropped

    def counted():
        collect()
        alive.append(sum(type(o) is fx.Graph for o in gc.get_objects()))

    monkeypatch.setattr(plan_probe, "collect_dropped", counted)
    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), gpu="h100", mesh="fsdp=2",
                        parallelize=target("examples/llama.py:parallelize"), find_max_batch=False)
    plan(cfg, 2, 4, confirm_top=0)
    assert len(alive) >= 3, alive
    assert max(alive) == 0, alive  # without the collection: one more graph per layout traced
