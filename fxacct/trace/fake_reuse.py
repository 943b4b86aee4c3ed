"""One module's fake tensors, made once for the captures of one profile.

A profile captures its module twice: the training step, then a forward for inference. Both make
the same fake stand-ins of its parameters and buffers (the same dtype, the same shapes) in a
FakeTensorMode of their own: 0.05 s of a Llama-2-70B profile (723 parameters, twice). A
``FakeReuse`` the caller passes to both (CaptureOptions.reuse) keeps the first capture's mode and
fake model for the second, which also finds the mode's dispatch cache warm, and the runs of identical blocks the first found
(fxacct.trace.replay_runs: 0.015 s of the same profile). What the training
step left on them is taken off first: the gradients its optimizer step was given. Its other
writes (the step's in-place updates, running statistics) change no shape, dtype or stride, the
only things a fake tensor has. A parallelized model's captures share its own prepared fake
tensors instead (fxacct.parallel.rank_capture)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxacct.trace.fake_mode import FakeTensorMode
from fxacct.trace.fake_model import FakeModel, fake_model
from fxacct.trace.replay_runs import find_runs


@dataclass
class FakeReuse:
    dtype: torch.dtype | None = None
    mode: FakeTensorMode | None = None
    fake: FakeModel | None = None
    runs: list | None = None

    def runs_of(self, model: torch.nn.Module) -> list:
        """find_runs(model), found once for the captures sharing this."""
        if self.runs is None:
            self.runs = find_runs(model)
        return self.runs

    def fakes(self, model: torch.nn.Module, dtype: torch.dtype | None) -> tuple[FakeTensorMode, FakeModel]:
        """The mode and fake model for a capture of ``model`` cast to ``dtype``."""
        if self.fake is None or dtype != self.dtype:
            self.dtype, self.mode = dtype, FakeTensorMode(allow_non_fake_inputs=True)  # a stray CPU tensor becomes fake
            with self.mode:
                self.fake = fake_model(model, dtype, self.mode)
        else:
            for t in self.fake.fake_of.values():
                t.grad = None
        return self.mode, self.fake
