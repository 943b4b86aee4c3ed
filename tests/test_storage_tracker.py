"""The dispatch-level storage tracker (the op-level memory oracle), checked against hand counts.

float32 is 4 bytes an element throughout; every expected figure is derived in a comment from
which storages are alive at each op.
"""

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxacct.runtime.storage_tracker import (
    StorageTracker,
    TrackedStep,
    default_loss,
    measure_inference,
    measure_training_step,
)


def test_views_share_a_storage_and_frees_lower_live_bytes():
    a = torch.randn(1000)  # 4000 B
    with StorageTracker() as t:
        t.track(a)
        assert (t.live_bytes, t.peak_op) == (4000, None)  # peak reached by track()
        b = a * 2              # +4000 → 8000
        c = b.view(10, 100)    # view of b: +0 → 8000
        assert t.live_bytes == 8000
        d = c + 1              # +4000 → 12000 (the peak, at add)
        del b                  # c still holds b's storage → 12000
        assert t.live_bytes == 12000
        del c                  # last reference to b's storage → 8000
        assert t.live_bytes == 8000
    assert (t.peak_bytes, t.peak_op) == (12000, "aten.add.Tensor")
    del d
    assert t.live_bytes == 4000


def test_inplace_ops_add_nothing():
    a = torch.randn(1000)  # 4000 B
    with StorageTracker() as t:
        t.track(a)
        a.mul_(2)
        a.add_(1).clamp_(max=3)
        a[:10].zero_()  # slice view + in-place: +0
    assert (t.live_bytes, t.peak_bytes, t.peak_op) == (4000, 4000, None)


def test_a_freed_temporary():
    a = torch.randn(1000)  # 4000 B
    with StorageTracker() as t:
        t.track(a)
        d = (a * 2) + 1  # temporary 4000 → 8000, d 4000 → 12000 at add, temporary freed → 8000
        assert t.live_bytes == 8000
    assert (t.peak_bytes, t.peak_op) == (12000, "aten.add.Tensor")
    del d


def test_storage_counted_once_however_often_seen():
    a = torch.randn(1000)  # 4000 B
    with StorageTracker() as t:
        t.track(a, a.view(10, 100), [a[::2], {"again": a}])
        t.track(a)
        assert t.live_bytes == 4000
        b = a.t().contiguous()  # 1-D t() is a view, contiguous() of a contiguous tensor returns it
        c = torch.ops.aten.alias(a)
        assert t.live_bytes == 4000
    del b, c


def test_free_after_exit_lowers_live_not_peak_and_subtracts_once():
    a = torch.randn(1000)  # 4000 B
    with StorageTracker() as t:
        t.track(a)
        b = a * 2  # 8000
        c = b[:500]  # view
    assert (t.live_bytes, t.peak_bytes) == (8000, 8000)
    del b
    gc.collect()
    assert t.live_bytes == 8000  # c keeps the storage
    del c
    assert t.live_bytes == 4000
    gc.collect()
    t.track(a)  # known storage: no change
    assert (t.live_bytes, t.peak_bytes) == (4000, 8000)
    del a
    assert t.live_bytes == 0
    gc.collect()
    assert t.live_bytes == 0  # the callback fired once


def test_freed_storage_address_reuse_is_a_new_storage():
    # Allocate and free repeatedly inside the mode: the allocator reuses addresses, but each
    # storage is counted when made and subtracted when freed.
    with StorageTracker() as t:
        for _ in range(20):
            x = torch.empty(256)  # +1024
            del x                 # −1024
        assert t.live_bytes == 0
    assert (t.peak_bytes, t.peak_op) == (1024, "aten.empty.memory_format")


def test_fake_and_meta_tensors_are_not_counted():
    with StorageTracker() as t:
        m = torch.empty(1000, device="meta")
        (m * 2).sum()
        with FakeTensorMode():
            f = torch.randn(1000)
            f + 1
    assert (t.live_bytes, t.peak_bytes) == (0, 0)
    del m, f


def test_resize_and_out_arguments_change_the_count():
    a = torch.randn(1000)  # 4000 B
    e = torch.empty(10)    # 40 B
    with StorageTracker() as t:
        t.track(a, e)                    # 4040
        e.resize_(1000)                  # e's storage grows 40 → 4000: 8000
        assert t.live_bytes == 8000
        o = torch.empty(0)               # 0-byte storage: nothing
        torch.add(a, 1, out=o)           # add.out resizes o to 4000 B: 12000
        assert t.live_bytes == 12000
    assert (t.peak_bytes, t.peak_op, t.adopted_bytes) == (12000, "aten.add.out", 0)
    del o


def test_untracked_input_is_adopted_and_fresh_tensors_are_allocations():
    u = torch.randn(250)  # 1000 B, never tracked
    with StorageTracker() as t:
        v = u + 1         # u adopted at its first use (+1000), v +1000 → 2000
        assert (t.live_bytes, t.adopted_bytes) == (2000, 1000)
        w = torch.tensor([1.0, 2.0])  # built outside the dispatcher, handed to lift_fresh: +8
        assert (t.live_bytes, t.adopted_bytes) == (2008, 1000)
    del v, w


def test_track_walks_modules_optimizers_and_grads():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)              # weight 12·4 = 48 B, bias 3·4 = 12 B
    bn = torch.nn.BatchNorm1d(3)             # weight, bias 12 + 12; running_mean, running_var 12 + 12;
    model = torch.nn.Sequential(lin, bn)     # num_batches_tracked int64 8 → 56 B
    opt = torch.optim.Adam(model.parameters())
    assert StorageTracker().track(model).live_bytes == 60 + 56
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    # grads: 60 + 24; Adam state per parameter: exp_avg + exp_avg_sq (2 × its bytes) and a float32
    # step tensor (4 B): 2·(60 + 24) + 4·4 = 184
    assert StorageTracker().track(model).live_bytes == 116 + 84
    assert StorageTracker().track(opt).live_bytes == 84 + 84 + 184  # params, grads, state
    assert StorageTracker().track(model, opt).live_bytes == 116 + 84 + 184


def _steady_state(factory):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(2, 4)
    opt = factory(list(model.parameters()))
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, x, opt


def _step(model, x, opt):
    loss = model(x).float().sum()
    loss.backward()
    del loss
    opt.step()


# Linear(4, 3, bias=False), batch 2, float32. W 3·4·4 = 48 B, x 2·4·4 = 32 B. Ops of the step:
#   forward  t(W) view +0; mm(x, Wᵀ) → y 2·3·4 = 24; .float() no-op; sum(y) → loss 4, then y dies
#   backward ones_like(loss) → seed 4; expand view; t view; mm(gᵀ, x) → dW 48; t, t, detach views
#            (AccumulateGrad keeps dW as W.grad); then the seed dies, and the step drops loss
#   SGD      in place (CPU: the single-tensor path): +0
# With baseline B: forward peak B + 24 + 4 at sum; backward peak B + 4 + 4 + 48 at the second mm.
def test_linear_sgd_step_by_hand():
    model, x, opt = _steady_state(lambda ps: torch.optim.SGD(ps, lr=0.1))
    with StorageTracker() as t:
        t.track(model, opt, x)
        assert t.live_bytes == 80               # B = 48 + 32, no SGD state without momentum
        _step(model, x, opt)
        assert t.live_bytes == 80 + 48          # W.grad remains
    assert (t.peak_bytes, t.peak_op) == (136, "aten.mm.default")  # 80 + 4 + 4 + 48
    assert t.adopted_bytes == 0


def test_linear_sgd_momentum_step_by_hand():
    # B = 48 + 32 + momentum_buffer 48 = 128; buf.mul_().add_() and param.add_() are in place
    model, x, opt = _steady_state(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    with StorageTracker() as t:
        t.track(model, opt, x)
        assert t.live_bytes == 128
        _step(model, x, opt)
    assert (t.peak_bytes, t.peak_op) == (184, "aten.mm.default")  # 128 + 4 + 4 + 48


def test_linear_adamw_step_by_hand():
    # B = 48 + 32 + exp_avg 48 + exp_avg_sq 48 + step 4 = 180. Backward peak 180 + 56 = 236.
    # After backward 180 + dW 48 = 228. AdamW single-tensor step: step_t += 1, param.mul_,
    # exp_avg.lerp_, exp_avg_sq.mul_().addcmul_() in place; then
    # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps):
    #   sqrt → 48 (276), div → 48 (324: the peak), the sqrt temporary dies (276), add_ in place;
    # param.addcdiv_ in place; denom dies → 228.
    model, x, opt = _steady_state(lambda ps: torch.optim.AdamW(ps, lr=0.1))
    with StorageTracker() as t:
        t.track(model, opt, x)
        assert t.live_bytes == 180
        _step(model, x, opt)
        assert t.live_bytes == 228
    assert (t.peak_bytes, t.peak_op) == (324, "aten.div.Tensor")


def test_reset_peak_measures_one_phase():
    model, x, opt = _steady_state(lambda ps: torch.optim.SGD(ps, lr=0.1))
    with StorageTracker() as t:
        t.track(model, opt, x)
        loss = model(x).sum()   # forward peak 80 + 24 + 4 = 108 at sum
        assert (t.peak_bytes, t.peak_op) == (108, "aten.sum.default")
        t.reset_peak()          # live 84: y died
        loss.backward()         # 84 + 4 + 48 = 136
    assert (t.peak_bytes, t.peak_op) == (136, "aten.mm.default")


def test_measure_training_step_matches_the_hand_count():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(2, 4)
    got = measure_training_step(model, x, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert got == TrackedStep(peak_bytes=136, peak_op="aten.mm.default", baseline_bytes=80,
                              adopted_bytes=0)
    # the loop holds its loss (4 B) through optimizer.step(), as `loss = ...; loss.backward();
    # optimizer.step()` does: test_linear_adamw_step_by_hand's 324 at div, plus the loss
    got = measure_training_step(model, (x,), torch.optim.AdamW)
    assert got == TrackedStep(peak_bytes=328, peak_op="aten.div.Tensor", baseline_bytes=180)
    assert model.weight.grad is not None  # the measured step ran for real


def test_measure_training_step_custom_loss_and_kwargs():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3, bias=False)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    # B = 48 + 32 = 80. forward: mm → 24 (104), mul → 24 (128, the peak); mm's output dies (104);
    # loss = out.mean(): 4 (108), out dies (84). backward: seed 4 (88); MeanBackward expands and
    # divides: div → 24 (112); MulBackward: mul → 24 (136); the div dies (112); mm → dW 48 (160).
    got = measure_training_step(Twice(), x, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                loss_fn=lambda out: out.mean(), kwargs={"scale": 2.0})
    assert (got.peak_bytes, got.peak_op, got.baseline_bytes) == (160, "aten.mm.default", 80)


def test_measure_inference_under_eval_and_no_grad():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    x = torch.randn(2, 4)
    # B = weight 48 + bias 12 + x 32 = 92; addmm → 24 (116); Dropout in eval runs no op
    assert measure_inference(model, x) == TrackedStep(116, "aten.addmm.default", 92)
    assert model.training  # restored
    model.eval()
    measure_inference(model, x)
    assert not model.training


def test_default_loss_sums_floating_outputs_in_pytree_order():
    out = {"a": torch.ones(2, dtype=torch.float16), "i": torch.ones(3, dtype=torch.long),
           "b": [torch.full((2,), 2.0)]}
    loss = default_loss(out)
    assert loss.dtype == torch.float32 and loss.item() == 2.0 + 4.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_storages_count_logical_bytes():
    a = torch.randn(1000, device="cuda")  # 4000 B (the allocator rounds to 4096; not seen here)
    with StorageTracker() as t:
        t.track(a)
        b = (a * 2) + 1
        torch.cuda.synchronize()
    assert (t.peak_bytes, t.peak_op, t.live_bytes) == (12000, "aten.add.Tensor", 8000)
    model = torch.nn.Linear(4, 3, bias=False).cuda()
    got = measure_training_step(model, torch.randn(2, 4, device="cuda"),
                                lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert (got.peak_bytes, got.baseline_bytes) == (136, 80)
    del b
