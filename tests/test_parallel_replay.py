"""Block replay under --mesh (fxacct.trace.replay in the inference capture of one rank): the
account, the collectives and the peaks must be the same, node for node, as tracing every block
(`dedup=False`), and a run of identical FSDP-wrapped blocks must really replay."""

from __future__ import annotations

import pytest

import fxacct
from fxacct.trace import replay as replay_module
from helpers import target

LLAMA = "examples/llama.py:Llama"
LIST_LLAMA = "tests/models/llama_list.py:ListLlama"
GPT = "examples/gpt2.py:GPT"
GPT_KW = dict(n_layer=4, n_head=4, n_embd=64, vocab_size=1001, block_size=32)  # 4 blocks: a run of 4

CASES = [
    (LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "examples/llama.py:parallelize"),
    (LLAMA, dict(n_layers=4), "tp=2", "examples/llama.py:parallelize_sp"),
    (LIST_LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "tests/models/llama_list.py:parallelize"),
    (LIST_LLAMA, dict(n_layers=4), "tp=2", "tests/models/llama_list.py:parallelize_sp"),
    (LIST_LLAMA, dict(n_layers=4), "tp=2", "tests/models/llama_list.py:parallelize"),
    (LIST_LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "tests/models/llama_list.py:parallelize_sp"),
    (LIST_LLAMA, dict(n_layers=4, hidden=96), "fsdp=4", "tests/models/llama_list.py:parallelize"),
    (GPT, GPT_KW, "fsdp=4", None),
    (GPT, GPT_KW, "fsdp=2", None),
]


def _profile(rel, kwargs, mesh, par, dedup):
    return fxacct.profile(fxacct.Config(target=target(rel), batch=2, kwargs=dict(kwargs), mesh=mesh, dedup=dedup,
                                        parallelize=target(par) if par else None))


@pytest.fixture
def replayed(monkeypatch) -> list:
    """The number of blocks each inference capture's BlockReplay replayed."""
    counts = []
    original = replay_module.BlockReplay.__exit__

    def counting(self, *exc):
        counts.append(self.replayed)
        return original(self, *exc)

    monkeypatch.setattr(replay_module.BlockReplay, "__exit__", counting)
    return counts


@pytest.mark.parametrize("rel,kwargs,mesh,par", CASES)
def test_mesh_same_account_both_ways(rel, kwargs, mesh, par, replayed):
    a = _profile(rel, kwargs, mesh, par, True)
    b = _profile(rel, kwargs, mesh, par, False)
    assert a.accounting.totals == b.accounting.totals
    assert a.accounting.nodes == b.accounting.nodes
    assert a.accounting.modules == b.accounting.modules
    assert a.memory.by_dtype == b.memory.by_dtype
    assert a.memory.peak_train == b.memory.peak_train
    assert a.memory.peak_inference == b.memory.peak_inference
    assert a.memory.rank_peak == b.memory.rank_peak
    assert a.parallel.rows == b.parallel.rows
    assert a.parallel.collectives == b.parallel.collectives
    assert replayed == [2]  # 4 identical blocks: the inference forward traces two and replays two
