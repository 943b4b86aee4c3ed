"""Ops that do no arithmetic: 0 FLOPs, but not 0 bytes.

`movement`: allocates new storage and copies (kind `copy`); `creation`: makes a tensor from sizes
alone (kind `creation`). Views need no entry: the schema's alias annotation makes them 0 FLOPs and
0 new bytes (fxacct.trace.aliasing).
"""

import torch

from fxacct.costs.registry import INDUCTOR_RANDOM, register_zero

aten = torch.ops.aten

register_zero(
    aten.clone, aten._to_copy, aten.copy, aten.copy_, aten.cat, aten.stack, aten.index_select,
    aten.gather, aten.embedding, aten.index, aten.repeat, aten.flip, aten.roll,
    aten.constant_pad_nd, aten.reflection_pad1d, aten.reflection_pad2d, aten.replication_pad2d,
    aten.slice_scatter, aten.select_scatter, aten.diagonal_scatter, aten.as_strided_scatter,
    aten.tril, aten.triu, aten.tril_, aten.triu_, aten.masked_select, aten.take,
    aten.repeat_interleave, aten._unsafe_index, aten.col2im, aten.im2col, aten.pixel_shuffle,
    aten.pixel_unshuffle, aten.upsample_nearest2d, aten.upsample_nearest2d_backward,
    aten.one_hot, aten.sort, aten.topk, aten.argsort, aten.unfold_backward, aten.narrow_copy,
    aten._reshape_copy, aten.view_copy, aten.permute_copy, aten.expand_copy, aten.t_copy,
    aten.transpose_copy, aten.unsqueeze_copy, aten.squeeze_copy, aten.split_with_sizes_copy,
    aten.set_, aten.resize_, aten.lift_fresh_copy, aten.fill_, aten.zero_, aten.bernoulli_,
    aten.normal_, aten.uniform_, aten.random_, aten.exponential_,
    aten._local_scalar_dense,  # .item(): a read of one value
    # scatter without a reduction writes values into a copy (Mixtral's routing one-hot)
    aten.scatter.src, aten.scatter.value, aten.scatter_.src, aten.scatter_.value,
    # backward of views and indexing: a zero tensor with the gradient written into a slice of it
    aten.slice_backward, aten.select_backward, aten.index_select_backward, aten.diagonal_backward,
    movement=True,
)
# checks that read only a tensor's metadata: torch.export inserts _assert_tensor_metadata before each
# dtype or device conversion (the stages of an automatic pipeline split carry them)
register_zero(aten._assert_tensor_metadata)
# in-place metadata changes (transpose_, unsqueeze_, as_strided_...): torch tags them
# inplace_view; they rewrite sizes and strides, not data
register_zero(torch.Tag.inplace_view)

register_zero(
    aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.full, aten.arange, aten.scalar_tensor,
    aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand, aten.randn,
    aten.randint, aten.rand_like, aten.randn_like, aten.randint_like, aten.randperm, aten.eye,
    aten.linspace, aten.logspace, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full,
    aten.new_empty_strided, aten.bernoulli, aten.tensor, aten._efficientzerotensor,
    torch.ops.prims.iota,  # arange as inductor's decompositions write it (torch/_refs: arange -> prims.iota)
    *INDUCTOR_RANDOM,  # a compiled graph's dropout draws, by name
    creation=True,
)
