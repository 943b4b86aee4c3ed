"""fxacct.trace.torch_private: the behaviour fxacct needs from each private PyTorch API it reads,
pinned, so a torch release that changes one fails here by name rather than mis-counting later.
(The FSDP2 hooks, fsdp_gathers_patched, fsdp_param_shard and fsdp_storage_resizes, are pinned by
tests/test_parallel_replay.py, whose replay counts drop to zero and whose accounts differ without
them.)"""

from __future__ import annotations

import torch

from fxacct.trace import torch_private as tp

aten = torch.ops.aten


def test_returns_nothing_reads_the_schema():
    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    assert tp.returns_nothing(torch.ops.fsdp.split_with_sizes_copy.default)  # "-> ()"
    assert not tp.returns_nothing(aten.mm.default)
    assert not tp.returns_nothing(aten.add_.Tensor)  # returns its self argument


def test_uncached_fake_dispatch_computes_the_op():
    mode = tp.FakeTensorMode()
    with mode:
        a, b = torch.empty(3, 5), torch.empty(5, 7)
    out = tp.fake_dispatch_uncached(mode, aten.mm.default, (tp.FakeTensor,), (a, b), {})
    assert type(out) is tp.FakeTensor and tuple(out.shape) == (3, 7) and out.fake_mode is mode


def test_autograd_numbers_link_a_backward_to_its_forward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(tp.current_autograd_number())
            return g * 2

    assert tp.current_autograd_number() is None  # outside the backward engine
    x = torch.ones(3, requires_grad=True)
    before = tp.next_autograd_number()
    Probe.apply(x).sum().backward()
    assert seen == [before]  # the Function's node took the next number, and its backward runs under it


def test_storage_key_is_shared_by_views_only():
    x = torch.empty(4, 4)
    assert tp.storage_key(x) == tp.storage_key(x.t()) == tp.storage_key(x[1:])
    assert tp.storage_key(x) != tp.storage_key(x.clone())


def test_reduce_op_type_reads_a_boxed_reduce_op():
    """c10d ops take their ReduceOp boxed as a ScriptObject, afresh per call; fxacct compares two
    calls' arguments by the reduction it reads back (fxacct.trace.records.comparable)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Args(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.allreduce_.default:
                seen.append(args[1:3])  # (ProcessGroup, ReduceOp), both boxed
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=tp.fake_store(), rank=0, world_size=2)
    try:
        t = torch.ones(4)
        with Args():
            dist.all_reduce(t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()
    assert [tp.reduce_op_type(op) for _, op in seen] == [int(dist.ReduceOp.SUM), int(dist.ReduceOp.MAX)] == [0, 4]
    assert [tp.reduce_op_type(group) for group, _ in seen] == [None, None]  # another ScriptObject


def test_replaced_binds_what_torch_passes_by_name():
    """A replaced function sees torch's call by the original's parameter names, however torch
    passed them, and runs the original as called: torch 2.15 calls FSDP2's copy-out with a keyword
    (all_gather_output_fn) 2.13's does not have."""
    from types import SimpleNamespace

    def default_fn(x):
        return x + 1

    def copy_out(result, params, group, *, output_fn=default_fn):
        return output_fn(result) * 10 + params - group

    owner = SimpleNamespace(copy_out=copy_out)
    calls = []

    def replacement(call):
        calls.append((call.get("result"), call.get("params"), call.get("group"), call.get("output_fn"),
                      call.get("absent"), call.at_defaults_except(("result", "params", "group"))))
        return call.run()

    with tp.replaced(owner, "copy_out", replacement, "owner"):
        assert owner.copy_out(1, 2, group=3) == (1 + 1) * 10 + 2 - 3
        assert owner.copy_out(1, 2, 3, output_fn=default_fn) == 19  # the default, passed explicitly
        assert owner.copy_out(1, params=2, group=3, output_fn=lambda x: x) == 1 * 10 + 2 - 3
    assert owner.copy_out is copy_out  # restored
    assert [c[:3] for c in calls] == [(1, 2, 3)] * 3
    assert [c[3] for c in calls[:2]] == [None, default_fn]  # not passed: absent from the call
    assert [c[4] for c in calls] == [None] * 3
    assert [c[5] for c in calls] == [True, True, False]  # another output_fn: not what the default does


def test_reduce_scatter_copy_in_is_the_op_fsdp_calls():
    """fsdp_reduce_scatter_copy_ins names the op FSDP2's reduce-scatter copy-in runs on this release
    (fsdp.chunk_cat before 2.15, fsdp.chunk_cat_mixed_dtype from 2.15): seen by a dispatch mode."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    grads, out = [torch.ones(4, 3), torch.full((2, 3), 2.0)], torch.empty(18)
    with Ops():
        _fsdp_collectives.foreach_reduce_scatter_copy_in(grads, out, 2)
    fsdp_ops = [op for op in seen if op.namespace == "fsdp"]
    assert len(fsdp_ops) == 1 and fsdp_ops[0] in tp.fsdp_reduce_scatter_copy_ins(), seen
    # chunk i of every gradient, one after another: [g0 rows 0-1, g1 row 0, g0 rows 2-3, g1 row 1]
    assert out.tolist() == [1.0] * 6 + [2.0] * 3 + [1.0] * 6 + [2.0] * 3


def test_top_saved_tensors_pack_is_the_innermost_hook():
    def outer(t):
        return t

    def inner(t):
        return t

    assert tp.top_saved_tensors_pack() is None
    with torch.autograd.graph.saved_tensors_hooks(outer, outer):
        assert tp.top_saved_tensors_pack() is outer
        with torch.autograd.graph.saved_tensors_hooks(inner, inner):
            assert tp.top_saved_tensors_pack() is inner
        assert tp.top_saved_tensors_pack() is outer


def test_checkpoint_recompute_is_seen_in_both_variants():
    """in_checkpoint_recompute is true inside the forward that torch.utils.checkpoint runs again
    in the backward, reentrant or not, and false in the first forward."""
    from torch.utils.checkpoint import checkpoint

    seen = []

    def fn(x):
        seen.append(tp.in_checkpoint_recompute())
        return (x * 2).sin()

    for reentrant in (False, True):
        seen.clear()
        x = torch.ones(3, requires_grad=True)
        checkpoint(fn, x, use_reentrant=reentrant).sum().backward()
        assert seen == [False, True], reentrant
