"""What real kernels allocate and return where their fake (meta) kernels differ: the dtype and
size of a storage (batch norm's saved statistics, a reduced loss's storage, oneDNN's LSTM
workspace) and the outputs themselves (an LSTM backward's two bias gradients). The recorder
applies them to every op it records (fxacct.trace.dispatch_recorder), so what autograd saves and
the storages' bytes are the eager run's."""

from __future__ import annotations

import torch

from fxacct.trace.records import Storages, itemsize

_aten = torch.ops.aten


def _batch_norm_stats(storages: Storages, args, out) -> None:
    """Batch norm's saved mean and inverse std take the dtype of its weight / running stats when
    those differ from the input's (a bf16 input with fp32 parameters under autocast): the CPU and
    CUDA kernels compute them in the parameter type (aten/src/ATen/native/Normalization.cpp,
    `mixed_type`), the fake kernel in the input's."""
    x = args[0]
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    if not params or params[0].dtype == x.dtype:
        return
    dtype = params[0].dtype
    for t in out[1:3]:
        if isinstance(t, torch.Tensor) and t.dtype != dtype:
            storages.real[storages.id_of(t)] = (dtype, t.numel() * itemsize(dtype))


def _unreduced_loss(storages: Storages, args, out) -> None:
    """mse_loss and smooth_l1_loss with a reduction return their 0-dim loss in the storage of the
    unreduced loss they computed first, which so lives as long as the loss (measured on CPU, torch
    2.13: F.mse_loss of two float32[64, 2048] gives a scalar whose storage is 524,288 B; the fake
    kernel allocates 4 B). The reduction is shared ATen code (Loss.cpp), not a CPU kernel."""
    if isinstance(out, torch.Tensor) and out.dim() == 0 and len(args) >= 2:
        numel = torch.Size(torch.broadcast_shapes(args[0].shape, args[1].shape)).numel()
        storages.real[storages.id_of(out)] = (out.dtype, numel * itemsize(out.dtype))


def _good_ld(dim: int, itemsize: int = 4) -> int:
    # oneDNN rnn_utils::get_good_ld: leading dimensions 64-byte aligned, and not a multiple of 256
    # elements (4K aliasing)
    ld = -(-dim // (64 // itemsize)) * (64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def _pages(n: int) -> int:
    return -(-n // 4096) * 4096  # oneDNN rnn_utils::set_offsets page-aligns every workspace part


def _onednn_lstm_workspace(storages: Storages, args, out) -> None:
    """The uint8 workspace CPU LSTM training keeps for its backward (mkldnn_rnn_layer's 4th
    output, saved by autograd): the fake kernel makes it empty. Its size is oneDNN's RNN training
    workspace, as its source computes it (src/cpu/rnn/rnn_utils.hpp, set_workspace_sizes and the
    leading dimensions of init_conf; rnn_utils.cpp, set_offsets: each part starts on a 4096-byte
    page; get_good_ld), for the one layer and direction torch runs per call (T steps, batch B,
    input I, hidden H; e the element size of the layer's dtype, the diff states in float32, the
    GEMM accumulator):
        gates   pages(T·B·ld(4H, e)·e)          ht          pages(T·B·ld(H, e)·e)
        states  pages(2(T+1)·B·ld(max(I, H), e)·e)        c   pages(2(T+1)·B·H·e)
        diff states and diff iter  2·pages(2(T+1)·B·ld(max(I, H), 4)·4)   diff c  pages(2(T+1)·B·H·4)
    Equal to the byte to torch 2.13's kernel on 157 random shapes (T, B to 40, I to 300, H 1 to
    400) in float32 and in bfloat16, the dtypes torch's CPU LSTM runs through oneDNN; others keep
    the fake size (an empty workspace). Inference (train=False) keeps no workspace."""
    x, w_hh = args[0], args[2]
    train = args[15] if len(args) > 15 else True
    ws = out[3] if isinstance(out, (tuple, list)) and len(out) > 3 else None
    if not train or ws is None or x.dtype not in _ONEDNN_RNN_DTYPES or ws.untyped_storage().nbytes() != 0:
        return
    t, b, i = x.shape
    h, e, acc = w_hh.shape[1], itemsize(x.dtype), 4
    states, cells = 2 * (t + 1) * b, 2 * (t + 1) * b * h
    nbytes = (_pages(t * b * _good_ld(4 * h, e) * e) + _pages(t * b * _good_ld(h, e) * e)
              + _pages(states * _good_ld(max(i, h), e) * e) + _pages(cells * e)
              + 2 * _pages(states * _good_ld(max(i, h), acc) * acc) + _pages(cells * acc))
    storages.real[storages.id_of(ws)] = (torch.uint8, nbytes)


_ONEDNN_RNN_DTYPES = (torch.float32, torch.bfloat16)


KERNEL_STORAGES = {
    op: _batch_norm_stats for op in (
        _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats, _aten._native_batch_norm_legit_no_training.default,
        _aten._native_batch_norm_legit_functional.default,
    )
}
KERNEL_STORAGES.update({op: _unreduced_loss for op in (_aten.mse_loss.default, _aten.smooth_l1_loss.default)})
KERNEL_STORAGES[_aten.mkldnn_rnn_layer.default] = _onednn_lstm_workspace


def _two_bias_gradients(out):
    """mkldnn_rnn_layer_backward's meta kernel returns one tensor as both bias gradients
    (torch/_meta_registrations.py: ``diff_b, diff_b``); the CPU kernel returns two (seven distinct
    storages, measured on torch 2.13), which autograd accumulates apart: the second gets its own."""
    if out[4] is out[3]:
        return (*out[:4], out[4].clone(), *out[5:])
    return out


# what the fake kernel returns made what the real one returns (called below the recorder, unrecorded)
KERNEL_OUTPUTS = {_aten.mkldnn_rnn_layer_backward.default: _two_bias_gradients}
