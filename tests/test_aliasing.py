"""`kind` (fxacct.trace.aliasing, from op schemas) against FakeTensor storage identity, node by node.

DESIGN.md: `view` means the output shares an input's storage; `copy`/`compute`/`creation`
allocate new storage; an in-place op writes into its first argument. The graph's meta["val"]
are the fake tensors of the trace, so ``untyped_storage()._cdata`` is the ground truth.
"""

import operator

import pytest
import torch
import torch.nn as nn
from helpers import config, meta_input, on_meta, profile_meta

import fxacct
import fxacct.trace.capture
from fxacct.trace.aliasing import KINDS

# meta["val"] holds what the capture kept of each fake output: a TensorMeta whose `storage` is
# the FakeTensor's storage identity (untyped_storage()._cdata, made unique over the capture), or
# the fake tensor itself
_TensorMeta = getattr(fxacct.trace.capture, "TensorMeta", torch.Tensor)
_TENSOR_TYPES = (torch.Tensor, _TensorMeta)


def _tensors(val) -> list:
    if isinstance(val, _TENSOR_TYPES):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, _TENSOR_TYPES)]
    return []


def _storage(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.untyped_storage()._cdata
    return t.storage


def kind_mismatches(graph) -> list[str]:
    """Every op node whose kind disagrees with storage identity, as 'op (kind, phase)'."""
    bad = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        kind = n.meta["fxacct"].kind
        assert kind in KINDS, n.format_node()
        outs = _tensors(n.meta["val"])
        if not outs:
            continue
        if n.target is torch.ops.aten.lift_fresh.default and n.args[0].meta["trace"].role == "constant":
            # a real constant made in Python (the optimizer's `step = torch.tensor(0.)`) turned into
            # a fake tensor: in eager lift_fresh returns its input, under FakeTensorMode the fake
            # wrapper has storage of its own by construction, so identity says nothing here
            continue
        # all_input_nodes includes tensors passed inside lists (cat, stack, index)
        inputs = {_storage(t) for a in n.all_input_nodes for t in _tensors(a.meta.get("val"))}
        if kind == "view":
            ok = _storage(outs[0]) in inputs
        elif kind in ("copy", "compute", "creation"):
            ok = all(_storage(o) not in inputs for o in outs)
        elif kind == "inplace":
            first = n.args[0]
            ok = isinstance(first, torch.fx.Node) and _storage(outs[0]) == _storage(_tensors(first.meta["val"])[0])
        else:
            ok = False  # `input` is only for placeholders
        if not ok:
            bad.append(f"{n.target} ({kind}, {n.meta['phase']})")
    return sorted(set(bad))


@pytest.mark.parametrize("name", ["GPT", "ResNet18", "TransformerLM", "MLP"])
def test_kind_matches_storage_identity(name):
    p = fxacct.profile(config(name, batch=2))
    kinds = {n.meta["fxacct"].kind for n in p.capture.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem}
    assert "view" in kinds and "compute" in kinds
    assert kind_mismatches(p.capture.graph) == []


def test_resnet_inplace_relu_is_inplace():
    p = fxacct.profile(config("ResNet18", batch=2))
    rows = [r for r in p.accounting.nodes if r.op == "aten.relu_.default"]
    assert rows and all(r.kind == "inplace" and r.output_bytes == 0 for r in rows)


def test_unsafe_view_exception_shares_storage():
    """aten._unsafe_view is the documented exception: schema says fresh, storage says view."""
    p = fxacct.profile(config("GPT", batch=2))
    nodes = [n for n in p.capture.graph.nodes if n.target is torch.ops.aten._unsafe_view.default]
    assert nodes
    for n in nodes:
        assert n.meta["fxacct"].kind == "view"
        assert _storage(n.meta["val"]) == _storage(n.args[0].meta["val"])


class UnsafeSplit(nn.Module):
    """nn.GRU on CPU splits its gate pre-activations with aten.unsafe_split: no alias annotation
    in the schema, but the chunks are views of the input's storage (a VIEW_EXCEPTIONS entry)."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 16, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


def test_gru_unsafe_split_kind_matches_storage_identity():
    p = profile_meta(on_meta(UnsafeSplit), (meta_input(2, 5, 8),))
    splits = [n for n in p.capture.graph.nodes if n.target is torch.ops.aten.unsafe_split.Tensor]
    assert splits, "nn.GRU on CPU no longer uses unsafe_split: pick another op for this check"
    assert all(n.meta["fxacct"].kind == "view" and n.meta["fxacct"].output_bytes == 0 for n in splits)
    assert kind_mismatches(p.capture.graph) == []
