"""Fused RNN kernels, costed as the cell matmuls they replace.

`mkldnn_rnn_layer` (CPU LSTM, one layer and direction): with G gates (LSTM 4, GRU 3, plain RNN 1),
hidden size H, input size I, T steps and batch B, each step computes x_t W_ihᵀ (B×I @ I×GH) and
h_{t-1} W_hhᵀ (B×H @ H×GH): matmul = 2·T·B·GH·(I + H). Elementwise per step: what torch's own
cell does besides the products (rnn_elementwise, rnn_backward_elementwise). The backward, like
any matmul backward, takes one product per required gradient: dX (2·T·B·GH·I, if the input
needs it), dW_ih (same size), the recurrent dh through W_hh (2·(T-1)·B·GH·H to go back in time,
2·T·B·GH·H when hx needs a gradient too) and dW_hh (2·T·B·GH·H): the FLOPs of the gradients the
step needs, as FlopCounterMode counts torch's decomposed cells (fxacct's convention), although the
fused oneDNN kernel computes every gradient (its schema takes no output mask: a frozen input's dX
comes back nonzero). Its elementwise work does not depend on the mask.
"""

import torch

from fxacct.costs.registry import Flops, register
from fxacct.units import FLOPS_PER_FMA

aten = torch.ops.aten


def _steps_batch(x_shape, batch_first: bool):
    # (T, B, I) always: nn.LSTM transposes a batch_first input before calling the layer kernel and
    # still passes batch_first=True along (aten/src/ATen/native/mkldnn/RNN.cpp), so the flag
    # says nothing about this tensor's layout
    return x_shape[0], x_shape[1]


def rnn_elementwise(t, b, gh, h, has_biases) -> int:
    """Per step and batch row, what torch's own cells (lstm_cell, gru_cell, rnn_tanh_cell, lowered
    to core ATen) do besides the products: the two bias adds (2·GH, with biases), then
    LSTM (G = 4): x·W_ih + h·W_hh (GH), σ, σ, tanh, σ (GH), c = f·c + i·g (3H), h = o·tanh(c) (2H);
    GRU (G = 3): r, z pre-activation adds (2H), r·h_n and i_n + that (2H), σ, σ, tanh (3H),
      h' = n + z·(h - n) (3H);
    RNN (G = 1): the pre-activation add and tanh/relu (2H)."""
    if gh == 4 * h:
        cell = 2 * gh + 5 * h
    elif gh == 3 * h:
        cell = 10 * h
    else:
        cell = 2 * gh
    return t * b * ((2 * gh if has_biases else 0) + cell)


def rnn_backward_elementwise(t, b, gh, h, has_biases) -> int:
    """Per step and batch row: autograd through torch's own cell, lowered to core ATen, with every
    gradient computed (as the fused kernel does): LSTM 21H, GRU 16H, RNN 3H besides the products;
    the bias gradients, sums over the batch (2·GH, with biases); and the add that joins the
    output's gradient with the recurrent one from the next step (H)."""
    if gh == 4 * h:
        cell = 21 * h
    elif gh == 3 * h:
        cell = 16 * h
    else:
        cell = 3 * h
    return t * b * ((2 * gh if has_biases else 0) + cell + h)


@register(aten.mkldnn_rnn_layer)
def mkldnn_rnn_layer(x_shape, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode,
                     hidden_size, num_layers, has_biases, bidirectional, batch_first, train, *args,
                     out_shape, ctx, **kwargs) -> Flops:
    t, b = _steps_batch(x_shape, batch_first)
    gh, i = w_ih
    h = w_hh[1]
    matmul = FLOPS_PER_FMA * t * b * gh * (i + h)
    return Flops(matmul=matmul, other=rnn_elementwise(t, b, gh, h, has_biases))


@register(aten.mkldnn_rnn_layer_backward, wants_grad_mask=True)
def mkldnn_rnn_layer_backward(x_shape, w_ih, w_hh, b_ih, b_hh, hx, cx_tmp, output, hy, cy,
                              grad_output, grad_hy, grad_cy, reverse, mode, hidden_size, num_layers,
                              has_biases, train, bidirectional, batch_sizes, batch_first, *args,
                              out_shape, ctx, **kwargs) -> Flops:
    t, b = _steps_batch(x_shape, batch_first)
    gh, i = w_ih
    h = w_hh[1]
    # grad_mask follows the forward op's tensor inputs: (input, w_ih, w_hh, b_ih, b_hh, hx, cx);
    # None: all of them
    mask = ctx.grad_mask
    per_ih = FLOPS_PER_FMA * t * b * gh * i
    per_hh = FLOPS_PER_FMA * t * b * gh * h
    # recurrent dh_{t-1} = dgates_t · W_hh for t = 1..T-1; at t = 0 it is the gradient of hx,
    # computed only when hx needs one
    matmul = FLOPS_PER_FMA * (t if mask is None or mask[5] else t - 1) * b * gh * h
    matmul += per_ih if mask is None or mask[0] else 0  # dX = dgates · W_ih
    matmul += per_ih if mask is None or mask[1] else 0  # dW_ih = dgatesᵀ · X
    matmul += per_hh if mask is None or mask[2] else 0  # dW_hh = dgatesᵀ · H
    return Flops(matmul=matmul, other=rnn_backward_elementwise(t, b, gh, h, has_biases))
