"""Every storage on its line in the batch (fxacct.memory.fit_lines), and the largest-batch search
it steers (fxacct.memory.fit_search's ``guess``).

Oracles: a fresh trace at the batch the lines predict (its Lifetimes, storage for storage); the
answer of a scan over every batch for the synthetic curves; the traces the search asked for."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import config
from test_fit_search import CAPACITY, affine, convex, scan

import fxacct
import fxacct.api
from fxacct.load.source import load_model
from fxacct.memory.fit_lines import LineGuess, lines
from fxacct.memory.fit_search import largest_batch
from fxacct.memory.peak import Lifetimes
from fxacct.step import OneDevice, step_fit


def _traced(cfg, inputs_for, model, batch):
    a, kw = inputs_for(batch)
    return step_fit(replace(cfg, batch=batch), OneDevice(model, tuple(a), kw)).life


@pytest.mark.parametrize("name", ["MLP", "GPT"])
def test_lines_through_two_traces_are_the_trace_at_a_third_batch(name):
    cfg = config(name, batch=2, gpu="h100")
    model, _, _, inputs_for = load_model(cfg)
    at = lines(_traced(cfg, inputs_for, model, 2), _traced(cfg, inputs_for, model, 4), 2, 4)
    assert at is not None
    real = _traced(cfg, inputs_for, model, 11)
    assert at(11) == real  # every storage's bytes, birth, death and category
    assert sum(b for *_, b in real.born) > sum(b for *_, b in at(4).born)  # activations grew with the batch


def _life(born_bytes, op_names=("mm", "relu")) -> Lifetimes:
    return Lifetimes(resident=(("parameters", 4096),), born=((0, 1, "activations", born_bytes),),
                     op_names=op_names, op_phases=("forward", "forward"), born_storages=(7,), resident_storages=(3,))


def test_two_programs_or_sizes_off_a_whole_line_draw_none():
    assert lines(_life(200), _life(400), 2, 4)(10) == _life(1000)  # 100 B per example, none fixed
    assert lines(_life(200), _life(400, ("mm", "gelu")), 2, 4) is None  # another op: another program
    assert lines(_life(200), _life(403), 2, 4) is None  # 101.5 B per example: not whole
    assert lines(_life(400), _life(200), 2, 4) is None  # falls as the batch grows
    assert lines(_life(100), _life(400), 2, 4) is None  # 150 B per example, -200 B at batch 0
    assert lines(_life(200), _life(400), 4, 4) is None


def test_a_guess_steers_the_search_to_the_answer_and_its_proof():
    # the exact answer as the guess: the line's batch (4), the answer and the next batch, no more
    expected = scan(convex, CAPACITY)
    found, proven, probe = largest_batch(convex, 2, convex(2), CAPACITY, guess=lambda traced: expected)
    assert (found, proven) == (expected, True)
    assert sorted(probe.traced) == [2, 4, expected, expected + 1] and probe.calls == 3


@pytest.mark.parametrize("wrong", [1, 10**9, None])
def test_a_wrong_guess_costs_traces_never_the_answer(wrong):
    found, proven, _ = largest_batch(affine, 2, affine(2), CAPACITY, guess=lambda traced: wrong)
    assert (found, proven) == (scan(affine, CAPACITY), True)


def test_a_line_guess_a_trace_refutes_is_dropped():
    # storages on lines through batches 2 and 4 say 10 fits (1,000 B); a trace at 10 said it does not
    guess = LineGuess(lambda batch, traced, life: sum(b for *_, b in life.born), capacity=1_000)
    guess.add(2, _life(200))
    guess.add(4, _life(400))
    assert guess({2: 200, 4: 400}) == 10
    assert guess({2: 200, 4: 400, 11: 1_100}) == 10  # 11 does not fit: the proof the guess asked for
    assert guess({2: 200, 4: 400, 10: 1_001}) is None


def test_a_real_model_is_proven_in_two_traces_after_the_line(monkeypatch):
    """GPT on an A100-40GB: the reserved bytes stay flat from batch 2 to 16 (whole segments), then
    the lines through 2 and 16 name the answer: two traces prove it (the totals' line alone asked
    24 traces: tests/test_fit_search.py's oracle)."""
    asked = []
    real = fxacct.api.step_fit

    def counted(cfg, capturer):
        asked.append(cfg.batch)
        return real(cfg, capturer)

    monkeypatch.setattr(fxacct.api, "step_fit", counted)
    p = fxacct.profile(config("GPT", batch=2, gpu="a100-40gb"))
    found = p.memory.fit.max_batch
    assert p.memory.fit.max_batch_verified
    assert asked == [4, 8, 16, found, found + 1]
