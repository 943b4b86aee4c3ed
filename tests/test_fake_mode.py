"""fxacct.trace.fake_mode's short path against eager, op by op: the same shape, strides, storage
offset, dtype, device and storage (shared with the input for a view, of the same size for a new
tensor), a refusal where eager refuses; against torch's own FakeTensorMode for `to_empty`'s
`empty_like` of a meta tensor; and a whole --mesh account,
whose FSDP2 hooks make thousands of such ops, equal node for node to one traced without it."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import pytest
import torch
from helpers import assert_same_account, target
from hypothesis import given

import fxacct
from fxacct.trace import fake_mode
from fxacct.trace import torch_private as tp

aten = torch.ops.aten


@st.composite
def base_tensors(draw):
    """(shape, a permutation of its dims, storage offset): the input is a possibly transposed,
    offset view into a larger buffer, so strides and offsets are not the trivial ones."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    perm = tuple(draw(st.permutations(range(len(shape)))))
    return shape, perm, draw(st.integers(0, 3))


def _make(mode, case, dtype=torch.float32):
    shape, perm, offset = case
    numel = 1
    for s in shape:
        numel *= s
    with mode:
        flat = torch.empty(numel + offset, dtype=dtype)
        return flat[offset:].view(shape).permute(perm)


@st.composite
def view_calls(draw):
    """(op, extra arguments as a function of the input's shape) for every short-path view."""
    case = draw(base_tensors())
    shape, perm = case[0], case[1]
    dims = tuple(shape[p] for p in perm)  # the permuted input's shape
    rank = len(dims)
    d = draw(st.integers(0, rank - 1))
    e = draw(st.integers(0, rank - 1))
    numel = 1
    for s in dims:
        numel *= s
    calls = [
        (aten.detach.default, ()),
        (aten.alias.default, ()),
        (aten.transpose.int, (d, e)),
        (aten.permute.default, (list(reversed(range(rank))),)),
        (aten.unsqueeze.default, (d,)),
        (aten.squeeze.dim, (d,)),
        (aten.expand.default, ([2, *dims],)),
        (aten.as_strided.default, ([numel], [1], 0)),
        (aten.view.default, ([numel],)),  # raises where the permuted input is not viewable
        (aten._unsafe_view.default, ([-1],)),
    ]
    if rank <= 2:
        calls.append((aten.t.default, ()))
    return case, draw(st.sampled_from(calls))


def _described(t: torch.Tensor, base: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
            t.untyped_storage().nbytes(), t.untyped_storage()._cdata == base.untyped_storage()._cdata)


def _addressed(d):
    """A description with the strides of size-1 dims left out: they address no memory, and
    empty_like's meta kernel and eager's differ there ((2, 1) of strides (1, 2) under
    preserve_format: eager keeps 2, the meta kernel FakeTensorMode runs too gives 1)."""
    if d == "refused":
        return d
    shape, stride, *rest = d
    return (shape, tuple(s if n > 1 else None for n, s in zip(shape, stride)), *rest)


def _both(func, args_of, case, kwargs=None):
    """(fxacct's short path, eager on real CPU tensors): each a description, or "refused". Eager
    is the oracle: FakeTensorMode's own view (torch's reference reshape helper) accepts some views
    eager refuses, a (2, 1, 2) tensor of strides (1, 1, 2) viewed as (4,) among them."""
    results = []
    for ctx, fast in ((fake_mode.FakeTensorMode(), True), (torch.device("cpu"), False)):
        x = _make(ctx, case)
        args = args_of(x)
        try:
            if fast:  # the short path itself, so the comparison cannot pass by falling back
                out = ctx._short(func, args, dict(kwargs or {}))
                assert out is not None, f"{func} did not take the short path"
            else:
                out = func(*args, **(kwargs or {}))
            results.append(_described(out, x))
        except RuntimeError:
            results.append("refused")
    return results


@given(view_calls())
def test_short_views_equal_eager(call):
    case, (func, extra) = call
    fast, stock = _both(func, lambda x: (x, *extra), case)
    assert fast == stock


@given(base_tensors(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       st.sampled_from([torch.contiguous_format, torch.preserve_format, torch.channels_last]))
def test_short_allocations_equal_eager(case, dtype, memory_format):
    shape = case[0]
    if memory_format is torch.channels_last and len(shape) != 4:
        memory_format = torch.preserve_format
    new = {"dtype": dtype, "device": torch.device("cpu")}
    layout = torch.contiguous_format if memory_format is torch.preserve_format else memory_format
    fast, stock = _both(aten.empty.memory_format, lambda x: (list(shape),), case, {**new, "memory_format": layout})
    assert fast[:6] == stock[:6] and fast[3] == dtype
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1] * 2  # padded rows: not the contiguous strides
    fast, stock = _both(aten.empty_strided.default, lambda x: (list(shape), strides), case, new)
    assert fast[:6] == stock[:6] and fast[1] == tuple(strides)
    # empty_like follows the input's layout under preserve_format, and its device with none given;
    # zeros_like and ones_like (an optimizer's state) alike
    for like in (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default):
        fast, stock = _both(like, lambda x: (x,), case, {"memory_format": memory_format})
        assert _addressed(fast)[:6] == _addressed(stock)[:6]
        assert not fast[6] and not stock[6]  # a new storage, not the input's
    # to_empty of a model built on meta: empty_like of a meta tensor, on the device asked or its own
    for device in ({"device": torch.device("cpu")}, {}):
        meta = _make(torch.device("meta"), case)
        fast_mode, stock_mode = fake_mode.FakeTensorMode(allow_non_fake_inputs=True), tp.FakeTensorMode(
            allow_non_fake_inputs=True)
        fast = fast_mode._short(aten.empty_like.default, (meta,), {"memory_format": memory_format, **device})
        with stock_mode:
            stock = aten.empty_like.default(meta, memory_format=memory_format, **device)
        assert type(fast) is type(stock) and _described(fast, meta) == _described(stock, meta)


@given(base_tensors(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.booleans())
def test_fresh_and_alias_equal_the_modes_own(case, dtype, strided):
    """fake_mode.fresh (a replayed block's outputs and gradients, a capture's parameters) and
    fake_mode.alias (the engine's detach) made below every Python mode: the tensor the mode's own
    dispatch of empty_strided / empty / detach makes, of that mode, on the same device, with a new
    storage (fresh) or the input's (alias)."""
    mode = fake_mode.FakeTensorMode()
    x = _make(mode, case, dtype)
    shape, stride = tuple(x.shape), x.stride()
    made = fake_mode.fresh(mode, shape, stride if strided else None, dtype)
    with mode:
        stock = torch.empty_strided(shape, stride, dtype=dtype) if strided else torch.empty(shape, dtype=dtype)
    assert type(made) is type(stock) is tp.FakeTensor and made.fake_mode is mode
    assert _described(made, x) == _described(stock, x) and not _described(made, x)[6]
    view = fake_mode.alias(x)
    with mode:
        stock = x.detach()
    assert type(view) is tp.FakeTensor and view.fake_mode is mode and not view.requires_grad
    assert _described(view, x) == _described(stock, x) and _described(view, x)[6]  # x's own storage


def test_alias_declines_what_the_short_path_would():
    """alias answers None (the caller dispatches detach) where fxacct's short path would not take it:
    a real tensor, another mode's fake, a fake with a constant value, torch's own FakeTensorMode."""
    mode = fake_mode.FakeTensorMode(allow_non_fake_inputs=True)
    with tp.FakeTensorMode() as other:
        foreign = torch.empty(4, 4)
    constant = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor([1.0, 2.0]), make_constant=True)
    for t in (torch.empty(4, 4), foreign, constant):
        assert fake_mode.alias(t) is None
    assert foreign.fake_mode is other
    # fresh in torch's own mode: dispatched inside it (entered here, or already in force)
    for ctx in (contextlib.nullcontext(), other):
        with ctx:
            made = fake_mode.fresh(other, (2, 3), (1, 2), torch.bfloat16)
        assert type(made) is tp.FakeTensor and made.fake_mode is other and made.stride() == (1, 2)


def test_short_path_declines_what_it_cannot_answer():
    mode = fake_mode.FakeTensorMode(allow_non_fake_inputs=True)
    other = tp.FakeTensorMode()
    with other:
        foreign = torch.empty(4, 4)
    # a fake tensor with its value kept (FakeTensorMode propagates small literals' values)
    constant = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor([1.0, 2.0]), make_constant=True)
    assert constant.constant is not None
    for t in (torch.empty(4, 4), foreign, constant):  # a real tensor, another mode's, a constant
        assert mode._short(aten.detach.default, (t,), {}) is None
    with mode:
        x = torch.empty(4, 4)
    assert mode._short(aten.empty.memory_format, ([4],), {"layout": torch.sparse_coo}) is None
    assert mode._short(aten.view.default, (x, [16]), {}) is not None


@pytest.mark.slow  # mesh traces twice; the short path's eager checks stay fast
def test_mesh_account_equal_without_short_path(monkeypatch):
    """FSDP2 + TP on the llama example: its hooks' views and buffers go the short way; the
    account must be the one torch's own dispatch gives."""
    def profile():
        return fxacct.profile(fxacct.Config(
            target=target("examples/llama.py:Llama"), batch=2, kwargs=dict(n_layers=3), mesh="fsdp=2,tp=2",
            parallelize=target("examples/llama.py:parallelize")))

    fast = profile()
    monkeypatch.setattr(fake_mode.FakeTensorMode, "_short", lambda self, func, args, kwargs: None)
    monkeypatch.setattr(fake_mode.FakeTensorMode, "_uncached", lambda self, func, types, args, kwargs:
                        tp.FakeTensorMode.dispatch(self, func, types, args, kwargs))
    assert_same_account(fast, profile())


def test_an_account_with_fxacct_s_own_tensors_made_below_the_modes_equals_one_with_them_dispatched(monkeypatch):
    """A replayed model's step (train and inference) with the tensors fxacct makes itself made below
    the Python modes (fake_mode.fresh: replayed outputs and gradients, fake parameters; fake_mode.alias:
    the engine's detach of each gradient) and with them dispatched through every mode, as before:
    node for node the same account. Both shortcuts are counted, so the comparison is not vacuous."""
    from fxacct.trace import dispatch_recorder, fake_model, replay, replay_node

    def profile():
        return fxacct.profile(fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, kwargs=dict(n_layers=4)))

    made = {"fresh": 0, "alias": 0}

    def counted(name, fn):
        def run(*args):
            out = fn(*args)
            made[name] += out is not None
            return out
        return run

    for module in (replay, replay_node, fake_model):
        monkeypatch.setattr(module, "fresh", counted("fresh", fake_mode.fresh))
    monkeypatch.setattr(dispatch_recorder, "alias", counted("alias", fake_mode.alias))
    fast = profile()
    assert made["fresh"] > 50 and made["alias"] > 20, made

    for module in (replay, replay_node, fake_model):
        monkeypatch.setattr(module, "fresh", lambda mode, shape, stride, dtype: fake_mode.dispatched_empty(
            shape, stride, dtype))
    monkeypatch.setattr(dispatch_recorder, "alias", lambda t: None)
    assert_same_account(fast, profile())


def test_out_only_ops_run_once_per_signature(monkeypatch):
    """FSDP2's split_with_sizes_copy writes into its ``out`` views and returns nothing: a second
    call of the same signature skips the kernel. A call whose kernel resized an ``out`` (wrong
    shapes) or refused (sizes not summing to the input's) is never taken for done."""
    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    op = torch.ops.fsdp.split_with_sizes_copy.default
    ran = []
    kernel = tp.fake_dispatch_uncached
    monkeypatch.setattr(tp, "fake_dispatch_uncached", lambda mode, func, *rest: ran.append(func) or kernel(
        mode, func, *rest))
    with fake_mode.FakeTensorMode():
        for _ in range(3):
            op(torch.empty(2, 10), [4, 6], 1, out=[torch.empty(2, 4), torch.empty(2, 6)])
        assert len(ran) == 1
        src = torch.empty(2, 10)
        op(src, [4, 6], 1, out=[src[:, :4], src[:, 4:]])  # the outs share the input's storage: another signature
        assert len(ran) == 2
        for _ in range(2):  # the kernel resizes each empty out, as eager's does: run every time
            wrong = [torch.empty(0), torch.empty(0)]
            op(src, [4, 6], 1, out=wrong)
            assert [tuple(w.shape) for w in wrong] == [(2, 4), (2, 6)]
        assert len(ran) == 4
        for _ in range(2):
            with pytest.raises(RuntimeError, match="split_with_sizes"):
                op(src, [4, 5], 1, out=[torch.empty(2, 4), torch.empty(2, 5)])
        assert len(ran) == 6


def test_a_view_the_kernel_refuses_is_the_models_error(tmp_path):
    """The short path runs eager's own view kernel: its refusal is the model's error (exit 3)
    at the model's line, with eager's message, not an internal one from fxacct's frame."""
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    model = tmp_path / "badview.py"
    model.write_text("import torch\n\n\nclass M(torch.nn.Module):\n    def __init__(self):\n"
                     "        super().__init__()\n        self.l = torch.nn.Linear(4, 4)\n\n"
                     "    def forward(self, x):\n        return self.l(x).t().view(-1)\n")
    result = CliRunner().invoke(cli, ["profile", f"{model}:M", "--input", "float[B,4]", "--batch", "3"])
    assert result.exit_code == 3, result.output
    assert "view size is not compatible" in result.output and "badview.py:10" in result.output
