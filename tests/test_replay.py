"""Repeated blocks traced once (fxacct.trace.replay, fxacct.trace.replay_train): the account must be the
same, node for node and byte for byte, as tracing every block (`dedup=False`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_account, target

import fxacct
from fxacct.trace import dispatch_recorder as recorder_module
from fxacct.trace.replay import find_runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from llama_shapes import Llama  # noqa: E402


def _accounts(model, args, **config):
    out = []
    for dedup in (True, False):
        out.append(fxacct.profile_module(model, args, {}, fxacct.Config(batch=args[0].shape[0], dedup=dedup,
                                                                         **config)))
    return out


def _tiny_llama(layers=4):
    with torch.device("meta"):
        return Llama(vocab=64, d=32, L=layers, h=4, kvh=2, ff=48, T=8)


@pytest.mark.slow  # the GPT-2 replay tests stay fast
@pytest.mark.parametrize("config", [
    {}, {"optimizer": "sgd"}, {"amp": torch.bfloat16}, {"gpu": "h100", "find_max_batch": False},
    {"gpu": "h100", "amp": torch.bfloat16, "find_max_batch": False}, {"input_requires_grad": True},
])
def test_llama_shaped_model_same_account_both_ways(config):
    idx = torch.empty(2, 8, dtype=torch.long, device="meta")
    a, b = _accounts(_tiny_llama(), (idx,), **config)
    assert_same_account(a, b)


@pytest.mark.parametrize("config", [{"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "master_weights": True},
                                    {"optimizer": "adagrad"}, {"amp": torch.bfloat16},
                                    {"amp": torch.float16, "optimizer": "sgd"}])
def test_gpt_example_same_account_both_ways(config):
    from fxacct.load.model_spec import build, example_inputs, resolve

    obj, module = resolve(str(Path(__file__).resolve().parents[1] / "examples/gpt2.py") + ":GPT")
    model = build(obj, dict(n_layer=4, n_head=4, n_embd=64, vocab_size=100, block_size=16), "GPT")
    args, _ = example_inputs(model, module, 2)
    a, b = _accounts(model, args, **config)
    assert_same_account(a, b)


@pytest.fixture
def dispatched(monkeypatch) -> dict:
    """{"n": ops the recorder has seen}: counts every op dispatched on fake tensors."""
    calls = {"n": 0}
    original = recorder_module.Recorder.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        calls["n"] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(recorder_module.Recorder, "__torch_dispatch__", counting)
    return calls


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_replay_records_fewer_dispatched_ops(dispatched, amp):
    idx = torch.empty(1, 8, dtype=torch.long, device="meta")
    model = _tiny_llama(layers=8)
    counts = []
    for dedup in (True, False):
        dispatched["n"] = 0
        fxacct.profile_module(model, (idx,), {}, fxacct.Config(batch=1, dedup=dedup, amp=amp))
        counts.append(dispatched["n"])
    # 8 layers: with replay only the two probe blocks (and nothing per replayed block) run on
    # fake tensors, so far fewer ops are dispatched; the graphs are equal (test above)
    assert counts[0] < counts[1] / 2, counts


class Numbered(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_an_int_that_differs_from_the_first_two_blocks_on_is_a_label():
    # blocks 0 and 1 carry different values, so their op comparison probes two values: one run
    assert len(find_runs(Stack([Numbered(i) for i in range(4)]))) == 1
    assert len(find_runs(Stack([Numbered(0) for _ in range(4)]))) == 1
    # blocks 0 and 1 agree, block 2 does not: nothing proves the new value changes nothing, so the
    # run splits where the value changes ([0, 0] is too short; [1, 1, 1] is a run)
    runs = find_runs(Stack([Numbered(i) for i in (0, 0, 1, 1, 1)]))
    assert [[fqn for fqn, _ in run] for run in runs] == [["blocks.2", "blocks.3", "blocks.4"]]


class _Config:
    """A plain config object, as Hugging Face blocks hold one."""

    def __init__(self, layer_types):
        self.layer_types = layer_types


class TableSelected(nn.Module):
    """What the block does is chosen at run time through a per-layer table: config.layer_types[layer_idx]."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.relu(y) if self.config.layer_types[self.layer_idx] == "sliding" else y * 2


class Scaled(Numbered):
    def forward(self, x):
        return self.lin(x) * (self.layer_idx + 1)


def _table_stack(types):
    config = _Config(types)
    with torch.device("meta"):
        return Stack([TableSelected(config, i) for i in range(len(types))])


def test_a_label_read_through_a_per_layer_table_must_agree_there():
    # blocks 0 and 1 are both "full": their ops match, but block 2 is "sliding": not one run
    assert find_runs(_table_stack(["full", "full", "sliding", "full", "full"])) == []
    assert len(find_runs(_table_stack(["full"] * 5))) == 1


@pytest.mark.parametrize("config", [{}, {"optimizer": "sgd"}])
@pytest.mark.parametrize("make", [
    pytest.param(lambda: _table_stack(["full", "full", "sliding", "full", "full", "sliding"]), id="table"),
    pytest.param(lambda: _table_stack(["full"] * 5), id="table-uniform"),
    pytest.param(lambda: Stack([Scaled(i) for i in range(5)]), id="scale"),
])
def test_labelled_blocks_same_account_both_ways(make, config):
    with torch.device("meta"):
        model = make()
    a, b = _accounts(model, (torch.empty(2, 4, device="meta"),), **config)
    assert_same_account(a, b)


def test_shared_blocks_are_not_a_run():
    block = nn.Linear(4, 4)
    model = Stack([block, block, block])
    assert find_runs(model) == []


def test_blocks_that_differ_at_run_time_fall_back_to_a_full_trace():
    """tests/models/alternating.py: blocks of one class, parameters and attributes whose forward
    takes another path on every other call; the probe of two blocks must see the difference."""
    def run(dedup):
        return fxacct.profile(fxacct.Config(target=target("tests/models/alternating.py:Stack"), batch=2, dedup=dedup))

    a, b = run(True), run(False)
    assert_same_account(a, b)
    relu = [n.module for n in a.accounting.nodes if n.op == "aten.relu.default"]
    assert relu == ["blocks.0", "blocks.2", "blocks.4"]  # the step's odd calls


def test_replay_leaves_the_blocks_as_they_were():
    idx = torch.empty(1, 8, dtype=torch.long, device="meta")
    model = _tiny_llama()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    fxacct.profile_module(model, (idx,), {}, fxacct.Config(batch=1))
    for name, m in model.named_modules():
        assert "forward" not in vars(m), name
        assert vars(m).keys() == before[name].keys(), name


# -- Hugging Face blocks: `layer_idx` differs per block ----------------------------------------------

def _hf(name: str, layers: int = 4, **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{name}Config")(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, **extra)
    with torch.device("meta"):
        return getattr(transformers, f"{name}ForCausalLM")(config)


def _hf_accounts(model, dedups=(True, False), **config):
    kwargs = {"input_ids": torch.empty(2, 8, dtype=torch.long, device="meta"), "use_cache": False}
    return [fxacct.profile_module(model, (), kwargs, fxacct.Config(batch=2, dedup=dedup, **config))
            for dedup in dedups]


def test_hugging_face_llama_blocks_form_one_run():
    model = _hf("Llama")
    assert [[fqn for fqn, _ in run] for run in find_runs(model)] == [[f"model.layers.{i}" for i in range(4)]]


@pytest.mark.slow  # 17 Hugging Face models traced twice
@pytest.mark.parametrize("config", [{}, {"optimizer": "sgd"}, {"amp": torch.bfloat16}])
@pytest.mark.parametrize("make", [
    pytest.param(lambda: _hf("Llama"), id="llama"),
    # layers alternate sliding-window and full attention: they must not share a template
    pytest.param(lambda: _hf("Qwen2", layers=6, use_sliding_window=True, sliding_window=4, max_window_layers=0,
                             layer_types=["sliding_attention", "full_attention"] * 3), id="qwen2-alternating"),
    pytest.param(lambda: _hf("Mistral", layers=5, sliding_window=4), id="mistral-sliding"),
    pytest.param(lambda: _hf("Gemma2", layers=5, sliding_window=4, head_dim=8), id="gemma2-alternating"),
])
def test_hugging_face_same_account_both_ways(make, config):
    a, b = _hf_accounts(make(), **config)
    assert_same_account(a, b)


def test_hugging_face_llama_replays(dispatched):
    model = _hf("Llama", layers=8)
    counts = []
    for dedup in (True, False):
        dispatched["n"] = 0
        _hf_accounts(model, (dedup,))
        counts.append(dispatched["n"])
    assert counts[0] < counts[1] / 2, counts


def _llama_example(layers=6):
    from fxacct.load.model_spec import build, resolve

    obj, _ = resolve(str(Path(__file__).resolve().parents[1] / "examples/llama.py") + ":Llama")
    with torch.device("meta"):
        return build(obj, dict(n_layers=layers), "Llama")


def test_module_dict_blocks_form_one_run():
    """examples/llama.py keeps its layers in a ModuleDict keyed "0".."n-1", as torchtitan does."""
    assert [[fqn for fqn, _ in run] for run in find_runs(_llama_example())] == [[f"layers.{i}" for i in range(6)]]


@pytest.mark.parametrize("config", [{}, {"amp": torch.bfloat16}])
def test_module_dict_llama_same_account_both_ways(config):
    idx = torch.empty(2, 64, dtype=torch.long, device="meta")
    a, b = _accounts(_llama_example(), (idx,), **config)
    assert_same_account(a, b)


def test_module_dict_llama_replays(dispatched):
    idx = torch.empty(2, 64, dtype=torch.long, device="meta")
    counts = []
    for dedup in (True, False):
        dispatched["n"] = 0
        fxacct.profile_module(_llama_example(8), (idx,), {}, fxacct.Config(batch=2, dedup=dedup))
        counts.append(dispatched["n"])
    assert counts[0] < counts[1] / 2, counts


class _Reversed(nn.Module):
    """Calls its blocks last to first: the second block of the run runs before the first."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))

    def forward(self, x):
        for block in reversed(self.blocks):
            x = block(x)
        return x


def test_blocks_called_out_of_order_same_account_both_ways():
    with torch.device("meta"):
        model = _Reversed()
    a, b = _accounts(model, (torch.empty(2, 16, device="meta"),))
    assert_same_account(a, b)


class _BatchNormBlocks(nn.Module):
    """Three Linear-BatchNorm-ReLU blocks: in training, each BatchNorm updates its running
    statistics and adds 1 to num_batches_tracked in place, while the replay's probe runs it too."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())
                                     for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_mutating_their_buffers_trace_as_eager():
    """A probe once left each buffer it mutated tagged with the probe's own record index, so the
    step's add_ pointed at an unrelated node (a KeyError with three blocks). Each block's
    num_batches_tracked += 1 reads that block's buffer placeholder, both ways, and the two
    accounts agree node for node."""
    model = _BatchNormBlocks()
    x = torch.empty(4, 16, device="meta")
    dedup, full = _accounts(model, (x,))
    assert_same_account(dedup, full)
    for prof in (dedup, full):
        adds = [n for n in prof.capture.graph.nodes if n.target is torch.ops.aten.add_.Tensor
                and n.args[1:] == (1,) and n.meta["fxacct"].phase == "forward"]
        assert [a.args[0].name for a in adds] == [f"layers_{i}_1_num_batches_tracked" for i in range(3)]
