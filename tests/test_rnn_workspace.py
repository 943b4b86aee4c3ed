"""CPU RNNs: what eager autograd saves (oneDNN's LSTM training workspace included) and the training
peak, against saved_tensors_hooks and the storage tracker on real eager CPU runs."""

import pytest
import torch
import torch.nn as nn
from helpers import eager_saved_bytes

import fxacct
from fxacct.runtime.storage_tracker import measure_training_step

T, B, I, H = 16, 8, 32, 64


class Recurrent(nn.Module):
    def __init__(self, cls, layers, bidirectional):
        super().__init__()
        self.rnn = cls(I, H, num_layers=layers, bidirectional=bidirectional)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.slow  # 8 real RNN steps; test_formulas keeps the RNN cost formulas fast
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_saved_bytes_and_peak_match_eager(cls, layers, bidirectional):
    torch.manual_seed(0)
    model, x = Recurrent(cls, layers, bidirectional), torch.randn(T, B, I)
    saved, _ = eager_saved_bytes(model, (x,))
    step = measure_training_step(model, (x,), torch.optim.AdamW)
    with torch.device("meta"):
        meta_model = Recurrent(cls, layers, bidirectional)
    p = fxacct.profile_module(meta_model, (torch.empty(T, B, I, device="meta"),), {}, fxacct.Config(batch=B))
    assert p.memory.activation_bytes == saved  # exact (measured: e.g. LSTM 1 layer 577,536 B)
    assert abs(p.memory.peak_train.bytes / step.peak_bytes - 1) <= 0.01


@pytest.mark.parametrize("shape", [(16, 8, 32, 64), (1, 1, 7, 16), (32, 4, 200, 48), (5, 2, 3, 300)])
def test_lstm_workspace_equals_the_kernels(shape):
    """The size fxacct gives the fake workspace equals the real kernel's output on these shapes."""
    from fxacct.trace.dispatch_recorder import _onednn_lstm_workspace
    from fxacct.trace.records import Storages

    t, b, i, h = shape
    args = (torch.randn(t, b, i), torch.randn(4 * h, i), torch.randn(4 * h, h), torch.zeros(4 * h),
            torch.zeros(4 * h), torch.zeros(b, h), torch.zeros(b, h), False, [], 2, h, 1, True, False, False, True)
    real = torch.ops.aten.mkldnn_rnn_layer(*args)[3]
    storages = Storages()
    fake_ws = torch.empty(0, dtype=torch.uint8)
    _onednn_lstm_workspace(storages, args, (None, None, None, fake_ws))
    assert storages.real[storages.id_of(fake_ws)] == (torch.uint8, real.untyped_storage().nbytes())


@pytest.mark.slow  # real low-precision RNN steps
@pytest.mark.parametrize("cls,dtype,warned", [
    (nn.LSTM, torch.bfloat16, True), (nn.LSTM, torch.float32, False), (nn.GRU, torch.bfloat16, False),
])
def test_a_low_precision_cpu_lstm_backward_is_flagged_where_eager_holds_more(cls, dtype, warned):
    """oneDNN's LSTM backward makes float32 gradients for bf16 inputs and casts them; the fake
    kernel returns bf16, so the bf16 account is below eager's peak (warned); fp32 and the GRU
    (another kernel) are within 1% and not warned."""
    torch.manual_seed(0)
    model, x = Recurrent(cls, 1, False).to(dtype), torch.randn(T, B, I, dtype=dtype)
    step = measure_training_step(model, (x,), torch.optim.AdamW)
    with torch.device("meta"):
        meta_model = Recurrent(cls, 1, False)
    p = fxacct.profile_module(meta_model, (torch.empty(T, B, I, device="meta"),), {},
                              fxacct.Config(batch=B, dtype=dtype))
    flagged = any("CPU LSTM backward runs in bfloat16" in w for w in p.warnings)
    assert flagged == warned, p.warnings
    ratio = step.peak_bytes / p.memory.peak_train.bytes
    assert (ratio > 1.05) if warned else abs(ratio - 1) <= 0.01, ratio
