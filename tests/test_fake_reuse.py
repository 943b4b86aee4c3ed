"""fxacct.trace.fake_reuse: a profile's inference capture takes its training capture's fake
tensors. What it records must be what a capture with fresh fake tensors records, after a training
step whose optimizer gave every parameter a gradient and updated it in place, and with BatchNorm's
running statistics written in place."""

from __future__ import annotations

import torch
from torch import nn

from fxacct.load.specs import OptimizerSpec
from fxacct.memory.peak import lifetimes, walk
from fxacct.trace.capture import CaptureOptions, capture
from fxacct.trace.fake_reuse import FakeReuse


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x):
        return self.blocks(self.bn(self.conv(x)).mean((2, 3)))


def test_the_inference_capture_on_reused_fakes_records_what_fresh_ones_do():
    model, x = Net(), torch.randn(2, 3, 8, 8, device="meta")
    reuse = FakeReuse()
    capture(model, (x,), {}, CaptureOptions(optimizer=OptimizerSpec("adamw"), reuse=reuse))
    assert all(reuse.fake.fake_of[id(p)].grad is not None for p in model.parameters())  # the step's
    again = capture(model, (x,), {}, CaptureOptions(inference=True, reuse=reuse))
    assert all(reuse.fake.fake_of[id(p)].grad is None for p in model.parameters())  # taken off
    fresh = capture(model, (x,), {}, CaptureOptions(inference=True))
    assert [(n.name, n.target, n.meta.get("val")) for n in again.graph.nodes] == \
        [(n.name, n.target, n.meta.get("val")) for n in fresh.graph.nodes]
    assert lifetimes(again) == lifetimes(fresh) and walk(lifetimes(again)) == walk(lifetimes(fresh))


class Shared(nn.Module):
    """One Linear under two names: torch's reparametrization writes back into the dict it is
    given what the module holds on the way out (the meta weight under the second name)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.alias = self.lin

    def forward(self, x):
        return self.alias(self.lin(x))


def test_a_module_under_two_names_keeps_its_fakes_for_the_next_capture():
    model, x = Shared(), torch.randn(3, 4, device="meta")
    own = list(model.parameters())
    reuse = FakeReuse()
    capture(model, (x,), {}, CaptureOptions(optimizer=OptimizerSpec("adamw"), reuse=reuse))
    assert all(t.device.type == "cpu" for t in reuse.fake.state.values())  # fake CPU tensors, no meta one
    again = capture(model, (x,), {}, CaptureOptions(inference=True, reuse=reuse))
    assert lifetimes(again) == lifetimes(capture(model, (x,), {}, CaptureOptions(inference=True)))
    assert all(a is b for a, b in zip(own, model.parameters(), strict=True))  # the user's module as it was


def test_the_second_capture_takes_the_first_ones_mode_and_fakes():
    model, x = Net(), torch.randn(2, 3, 8, 8, device="meta")
    reuse = FakeReuse()
    capture(model, (x,), {}, CaptureOptions(optimizer=OptimizerSpec("adamw"), reuse=reuse))
    mode, fake = reuse.mode, reuse.fake
    capture(model, (x,), {}, CaptureOptions(inference=True, reuse=reuse))
    assert reuse.mode is mode and reuse.fake is fake


def test_a_profile_makes_its_fake_model_once(monkeypatch):
    import fxacct
    import fxacct.trace.fake_reuse as fake_reuse

    made = []
    real = fake_reuse.fake_model
    monkeypatch.setattr(fake_reuse, "fake_model", lambda *a: made.append(1) or real(*a))
    fxacct.profile_module(Net(), (torch.randn(2, 3, 8, 8, device="meta"),))
    assert len(made) == 1  # the training step's, taken by the inference forward


def test_another_dtype_makes_its_own_fakes():
    model, x = Net(), torch.randn(2, 3, 8, 8, device="meta")
    reuse = FakeReuse()
    capture(model, (x,), {}, CaptureOptions(inference=True, reuse=reuse))
    first = reuse.fake
    capture(model, (x,), {}, CaptureOptions(inference=True, dtype=torch.bfloat16, reuse=reuse))
    assert reuse.fake is not first
    assert {t.dtype for t in reuse.fake.fake_of.values() if t.is_floating_point()} == {torch.bfloat16}
