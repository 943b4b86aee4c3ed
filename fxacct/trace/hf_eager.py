"""Hugging Face models take their eager path during capture: the one place fxacct answers
transformers' "am I being traced?" test.

transformers (5.x) asks ``transformers.utils.import_utils.is_tracing(tensor)`` before it reads a
tensor's values, and counts a fake tensor as tracing (``is_fake_tensor``). Under fxacct every
tensor is fake, so without this a Llama builds the explicit causal mask and repeats k/v for
grouped-query attention, which an eager run with no padded token skips (+7% activation bytes on
a tiny Llama). Inside ``hf_eager(model)``:

- ``is_fake_tensor(t)`` answers False for a fake tensor whose value an eager run would know
  (fxacct.trace.known_values: position ids from ``arange``, masks of ones, what is computed from
  them), so ``is_tracing`` answers as in eager;
- the value checks that follow (``(packed[:, -1] == 0).all()``, ``fast_all(padding_mask)``) are
  answered from those known values, so they take eager's branch without a data-dependent error;
- a tensor whose values come from the user's inputs (an ``attention_mask`` input) stays unknown:
  transformers then takes its general, traced path (the explicit mask), an upper bound.

It applies to every attention implementation the model's config selects (``eager``, ``sdpa``):
they share the mask code. transformers is never imported here: the patch is made only when the
model holds a ``transformers.PreTrainedModel``, so transformers is already loaded.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from fxacct.trace import torch_private as tp
from fxacct.trace.known_values import KnownValues, known


def _is_hugging_face(model: torch.nn.Module) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return base is not None and any(isinstance(m, base) for m in model.modules())


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """Parameters that are DTensors on a mesh with a ``tp`` dimension (fxacct.parallel's mesh
    names): tensor parallelism makes activations DTensors, which run each op on their local shards
    below this mode, so known values do not follow them (a Mixtral's packed-sequence check then
    needs a value no fake tensor has); such a model keeps transformers' traced path (the explicit
    mask, an upper bound: +3% on a Qwen3 at tp=2, T=64, against a real gloo run). Under FSDP2 alone
    the parameters are DTensors but the activations are plain, and the eager path is taken, as the
    real run takes it (exact at T=64 on Llama and Qwen3)."""
    return any("tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())
               for p in model.parameters() if tp.local(p) is not p)


def _eager_is_fake_tensor(x) -> bool:
    """transformers' ``is_fake_tensor`` as an eager run answers it: fake only if unknown."""
    return isinstance(x, tp.FakeTensor) and known(x) is None


@contextlib.contextmanager
def hf_eager(model: torch.nn.Module):
    """Enter around the traced forward (inside the fake-tensor mode and the recorder)."""
    imports = sys.modules.get("transformers.utils.import_utils")
    if imports is None or not hasattr(imports, "is_fake_tensor") or not _is_hugging_face(model) \
            or _tensor_parallel(model):
        yield
        return
    original = imports.is_fake_tensor
    imports.is_fake_tensor = _eager_is_fake_tensor
    try:
        with KnownValues():
            yield
    finally:
        imports.is_fake_tensor = original
