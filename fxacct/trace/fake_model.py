"""The fake stand-ins of a module's parameters, buffers and tensor attributes for a capture (or
the two of one profile: fxacct.trace.fake_reuse). Tied names share one fake tensor; the user's
module is changed only inside ``swapped``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from fxacct.load.inputs import BOUND
from fxacct.trace import torch_private as tp
from fxacct.trace.dispatch_recorder import Recorder
from fxacct.trace.fake_mode import FakeTensorMode, dispatched_empty, fresh


def fake_like(t: torch.Tensor, dtype: torch.dtype | None, mode: FakeTensorMode | None = None) -> torch.Tensor:
    """A fake CPU tensor with t's shape and strides (contiguous, cast to ``dtype`` where given and t
    is floating): call inside the FakeTensorMode, or give fxacct's ``mode`` (made at once)."""
    cast = dtype is not None and t.is_floating_point()
    shape, stride, dtype = t.shape, None if cast else t.stride(), dtype if cast else t.dtype
    return fresh(mode, shape, stride, dtype) if mode is not None else dispatched_empty(shape, stride, dtype)


def fake_input(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """fake_like for an input of the step, carrying the bound of its values (fxacct.load.inputs.BOUND):
    an --input's <N, or a real integer example's largest value + 1."""
    f = fake_like(t, dtype)
    bound = getattr(t, BOUND, None)
    if bound is None and t.dtype in _INDEX_DTYPES and t.numel() and t.device.type != "meta" \
            and not isinstance(t, tp.FakeTensor):
        with tp.disable_current_modes():  # the example's own values, past the fake mode
            bound = int(t.max()) + 1
    if bound is not None:
        setattr(f, BOUND, bound)
    return f


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class FakeModel:
    """The fake stand-ins of a module's tensors (tied names share one tensor)."""

    fake_of: dict  # id(real tensor) -> fake tensor
    state: dict  # every parameter and buffer name -> its fake tensor (for reparametrize_module)
    param_groups: dict  # id(parameter) -> its names
    buffer_groups: dict  # id(buffer) -> its names
    attributes: list  # (module, name, real, fake) of tensors kept as plain attributes

    @tp.torch_function_off  # fxacct's own reads (tp.no_torch_function)
    def trainable(self) -> list[torch.Tensor]:
        return [self.fake_of[pid] for pid in self.param_groups if self.fake_of[pid].requires_grad]


def fake_model(model: torch.nn.Module, dtype: torch.dtype | None, mode: FakeTensorMode) -> FakeModel:
    """The fakes of ``mode`` (fake_like), which is entered."""
    fake = FakeModel({}, {}, {}, {}, [])
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in fake.fake_of:
            # as the model has it, in inference too: under no_grad it records nothing, but autocast
            # caches its low-precision copy of a weight that requires grad until the region ends
            fake.fake_of[id(p)] = fake_like(p, dtype, mode).requires_grad_(p.requires_grad)
        fake.param_groups.setdefault(id(p), []).append(name)
        fake.state[name] = fake.fake_of[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in fake.fake_of:
            fake.fake_of[id(b)] = fake_like(b, dtype, mode)
        fake.buffer_groups.setdefault(id(b), []).append(name)
        fake.state[name] = fake.fake_of[id(b)]
    # tensors a module keeps as plain attributes (not parameters or buffers): swapped too
    fake.attributes = [(m, k, v, fake_like(v, dtype, mode)) for m in model.modules() for k, v in vars(m).items()
                       if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    return fake


@contextlib.contextmanager
def swapped(model: torch.nn.Module, fake: FakeModel, training: bool):
    """The model in train (or eval) mode with its tensors replaced by the fakes; everything restored
    on exit, whatever happens inside."""
    was_training = {m: m.training for m in model.modules()}
    try:
        model.train(training)
        for m, k, _, fake_tensor in fake.attributes:
            setattr(m, k, fake_tensor)
        # stack_weights: restored last in, first out, so a module registered under two names (one
        # Linear as .lin and .alias) gets its own tensors back, not the fake the second name saw;
        # a copy: torch writes what the module holds on the way out back into the dict it is given
        with tp.reparametrize_module(model, dict(fake.state), strict=False, stack_weights=True):
            yield
    finally:
        for m, flag in was_training.items():
            m.training = flag
        for m, k, original, _ in fake.attributes:
            setattr(m, k, original)


class PreparedModel(Protocol):
    """A model whose tensors were made fake before the capture (fxacct.parallel.rank_capture.Prepared:
    parallelized, then materialized in ``mode``): the capture runs in that mode, takes ``fake`` as
    the model's tensors, defers to the tensor subclasses in ``defer`` (DTensor) and lets it
    ``attach`` to the recorder."""

    mode: FakeTensorMode
    fake: FakeModel
    defer: tuple

    def attach(self, recorder: Recorder) -> None: ...
