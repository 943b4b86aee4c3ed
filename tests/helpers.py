"""Helpers shared by the tests: building on meta, example targets, and the FlopCounterMode oracle.

The oracle is independent of fxacct: it runs the model under ``FakeTensorMode`` with
``torch.utils.flop_counter.FlopCounterMode`` and differentiates the same loss fxacct uses
(DESIGN.md: the sum of ``t.float().sum()`` over every floating output).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import fxacct

ROOT = Path(__file__).resolve().parents[1]

# Small configs of every example: (target, constructor kwargs). Cheap enough to trace in < 0.5 s.
SMALL_EXAMPLES = {
    "TwoLayer": ("examples/two_layer.py:TwoLayer", {}),
    "DeepLinearModel": ("examples/deep_linear.py:DeepLinearModel", {}),
    "MLP": ("examples/mlp.py:MLP", dict(d_model=32, d_hidden=64, n_blocks=2)),
    "ResNet18": ("examples/resnet.py:ResNet18", dict(num_classes=10, image_size=32, width=8)),
    "GPT": ("examples/gpt2.py:GPT", dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, block_size=32)),
    "TransformerLM": ("examples/transformer_lm.py:TransformerLM",
                      dict(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=96, context_length=16)),
}


def target(rel: str) -> str:
    """'examples/x.py:Name' made absolute, so tests do not depend on the working directory."""
    path, _, name = rel.rpartition(":")
    return f"{ROOT / path}:{name}"


def config(name: str, batch: int = 2, **overrides) -> fxacct.Config:
    rel, kwargs = SMALL_EXAMPLES[name]
    return fxacct.Config(target=target(rel), batch=batch, kwargs=dict(kwargs), **overrides)


def load(cfg: fxacct.Config):
    """(model on meta, args, kwargs) for a Config's target, as fxacct.profile loads them."""
    from fxacct.load.source import load_model

    model, args, kwargs = load_model(cfg)[:3]
    return model, args, kwargs


def on_meta(factory, *args, **kwargs) -> torch.nn.Module:
    """Build a module on the meta device: parameters get shapes, never memory."""
    with torch.device("meta"):
        return factory(*args, **kwargs)


def model_flops(flops) -> int:
    """matmul + attention of one fxacct Flops: the classes FlopCounterMode counts."""
    return flops.matmul + flops.attention


def floating_loss(output) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    loss = leaves[0].float().sum()
    for t in leaves[1:]:
        loss = loss + t.float().sum()
    return loss


def flop_counter_oracle(model: torch.nn.Module, args=(), kwargs=None, *, output=None,
                        input_grads: bool = False) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step as torch.utils.flop_counter counts them.

    Recipe (the meta-built model and meta inputs are fakified on use by allow_non_fake_inputs):
    forward under FakeTensorMode + FlopCounterMode, the loss outside the counter, then
    ``torch.autograd.grad`` over the unique trainable parameters under a second counter.
    ``output`` picks the tensor(s) to sum from the model's output (``lambda o: o.logits`` for
    Hugging Face models). ``input_grads`` also differentiates w.r.t. the floating inputs.

    Hugging Face note: transformers 5.x models built on meta crash when run *plainly* on meta
    (``.all()``/``.item()`` in the mask code, DESIGN.md); under FakeTensorMode with
    ``allow_non_fake_inputs=True`` the same meta model and meta ``input_ids`` run fine, so no
    special recipe is needed beyond ``use_cache=False``.
    """
    kwargs = kwargs or {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        if input_grads:
            args = tuple(mode.from_tensor(a).requires_grad_(a.is_floating_point())
                         if isinstance(a, torch.Tensor) else a for a in args)
        with FlopCounterMode(display=False) as fc_forward:
            out = model(*args, **kwargs)
        if output is not None:
            out = output(out)
        loss = floating_loss(out)
        targets = [p for p in model.parameters() if p.requires_grad]  # .parameters() dedups ties
        if input_grads:
            targets += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        with FlopCounterMode(display=False) as fc_backward:
            torch.autograd.grad(loss, targets, allow_unused=True)
    return fc_forward.get_total_flops(), fc_backward.get_total_flops()


def profile_meta(model: torch.nn.Module, args=(), kwargs=None, batch: int | None = None,
                 **config) -> fxacct.Profile:
    """fxacct.profile_module with meta example inputs; batch defaults to the first input's dim 0."""
    if batch is None:
        first = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        batch = first.shape[0] if first is not None else 1
    return fxacct.profile_module(model, args, kwargs or {}, fxacct.Config(batch=batch, **config))


def meta_input(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def flop_counter_forward_by_module(model: torch.nn.Module, args=(), kwargs=None) -> dict[str, int]:
    """{module FQN: forward FLOPs} as torch.utils.flop_counter attributes them (inclusive; "" is the
    root). Only modules that were called appear: a ModuleList never runs, so it has no entry.

    Forward only: FlopCounterMode's backward attribution follows its ModuleTracker, which gives a
    gradient that several modules' inputs share (k_proj and v_proj reading one x, a ResNet shortcut)
    to whichever module's backward hook fired last; fxacct attributes by the autograd link instead."""
    root = type(model).__name__
    with FakeTensorMode(allow_non_fake_inputs=True), FlopCounterMode(display=False) as fc:
        model(*args, **(kwargs or {}))
    return {("" if key in ("Global", root) else key.removeprefix(root + ".")): sum(counts.values())
            for key, counts in fc.get_flop_counts().items()}


def eager_saved_bytes(model: torch.nn.Module, args=(), kwargs=None, amp: torch.dtype | None = None):
    """(total, {dtype name: bytes}) autograd saves during a real eager forward of ``model``: each
    storage once (``untyped_storage()._cdata``), parameters and buffers excluded, saved inputs
    included (DESIGN.md, ``activation_bytes``). The graph (and so every saved storage) stays alive
    until the sums are taken, so no storage address is reused while counting."""
    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in excluded and st._cdata not in seen:
            seen[st._cdata] = (st.nbytes(), t.dtype)
        return t

    autocast = torch.autocast("cpu", dtype=amp) if amp is not None else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = model(*args, **(kwargs or {}))
    by: dict[str, int] = {}
    for nbytes, dt in seen.values():
        name = str(dt).removeprefix("torch.")
        by[name] = by.get(name, 0) + nbytes
    del out
    return sum(by.values()), by



def eager_step_peak(model, args, loss_fn, target_tensor=None, optimizer=torch.optim.AdamW) -> int:
    """The storage tracker over one steady-state training step of the real ``model`` (one
    warm-up step first, as measure_training_step does; the gradients of the parameters and of
    any input that requires grad set to None after it), the target resident like the inputs."""
    import gc

    from fxacct.runtime.storage_tracker import StorageTracker

    opt = optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step():
        loss = loss_fn(model(*args), target_tensor)
        loss.backward()
        opt.step()
        return loss

    step()
    opt.zero_grad(set_to_none=True)
    for a in args:
        if isinstance(a, torch.Tensor):
            a.grad = None
    gc.collect()
    gc.disable()
    try:
        with StorageTracker() as tracker:
            tracker.track(model, opt, args, target_tensor)
            step()
    finally:
        gc.enable()
    assert tracker.adopted_bytes == 0
    return tracker.peak_bytes

def real_model(rel: str, kwargs: dict, batch: int, dtype: torch.dtype | None = None):
    """(CPU model with real weights, args, kwargs) for 'examples/x.py:Name', inputs from the
    model's own example_inputs on CPU; with ``dtype`` the model and floating inputs are cast."""
    from fxacct.load import model_spec

    obj, file_module = model_spec.resolve(target(rel))
    torch.manual_seed(0)
    model = obj(**kwargs)
    args, kw = model_spec.example_inputs(model, file_module, batch, device="cpu")
    if dtype is not None:
        model = model.to(dtype)
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        kw = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in kw.items()}
    return model, args, kw


def assert_same_account(a, b) -> None:
    """Two profiles of one model (block replay on and off) agree node for node: totals, nodes,
    modules, bytes by dtype and both peaks."""
    assert a.accounting.totals == b.accounting.totals
    assert a.accounting.nodes == b.accounting.nodes
    assert a.accounting.modules == b.accounting.modules
    assert a.memory.by_dtype == b.memory.by_dtype
    assert a.memory.peak_train == b.memory.peak_train
    assert a.memory.peak_inference == b.memory.peak_inference


def invoke_profile(*args):
    """``fxacct profile ARGS`` through click's runner, stderr apart from stdout where click allows."""
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli, ["profile", *args], catch_exceptions=False)


def assert_one_line_exit_2(result, needle: str) -> None:
    """A usage error: exit code 2 and one line on stderr that says ``needle``."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
