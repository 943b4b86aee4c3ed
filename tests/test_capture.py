"""The capture (fxacct.trace.capture): the user's module is left as it was, every forward node knows
its module, backward nodes link to their forward node, tied weights count once, and common
module types trace without unsupported ops."""


import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from helpers import config, flop_counter_oracle, meta_input, model_flops, on_meta, profile_meta, target

import fxacct
from examples.resnet import ResNet18

# every global hook registry of torch.nn.Module (forward, pre, backward, always-called, with-kwargs...)
GLOBAL_HOOK_DICTS = [name for name in dir(module_globals)
                     if name.startswith("_global_") and ("hooks" in name or name.endswith("hook"))
                     and isinstance(getattr(module_globals, name), dict)]


def _global_hooks():
    return {name: list(getattr(module_globals, name).keys()) for name in GLOBAL_HOOK_DICTS}


def _module_hooks(model):
    return {name: (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks),
                   list(m._backward_pre_hooks))
            for name, m in model.named_modules()}


def _snapshot(model):
    return dict(
        params=[(n, id(p), p.requires_grad, p.device, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)],
        buffers=[(n, id(b), b.device) for n, b in model.named_buffers(remove_duplicate=False)],
        training={n: m.training for n, m in model.named_modules()},
        hooks=_module_hooks(model),
        state_dict=list(model.state_dict().keys()),
        grads=[p.grad for p in model.parameters()],
    )


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_tracer_leaves_module_unchanged(device):
    torch.manual_seed(0)
    with torch.device(device):
        model = ResNet18(num_classes=10, image_size=16, width=4)
    # mixed modes and a user hook, both of which must survive
    model.eval()
    model.layer2.train()
    calls = []
    model.fc.register_forward_hook(lambda m, a, o: calls.append(1))
    before = _snapshot(model)
    global_before = _global_hooks()
    values = {n: t.clone() for n, t in model.state_dict().items()} if device == "cpu" else None

    p = profile_meta(model, (meta_input(2, 3, 16, 16),))

    assert p.accounting.totals.forward.matmul > 0
    assert calls  # the user's hook ran in the traced forward(s) (training, and inference)
    assert _snapshot(model) == before
    assert _global_hooks() == global_before
    if values is not None:  # BatchNorm running stats and num_batches_tracked untouched
        after = model.state_dict()
        assert all(torch.equal(after[n], v) for n, v in values.items())


def test_no_hooks_left_after_a_failed_trace():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            raise RuntimeError("boom")

    global_before = _global_hooks()
    model = on_meta(Boom)
    model.eval()
    with pytest.raises(fxacct.ModelError, match="boom"):
        profile_meta(model, (meta_input(2, 3),))
    assert _global_hooks() == global_before
    assert not model.training and not model.lin.training
    assert _module_hooks(model) == {"": ([], [], [], []), "lin": ([], [], [], [])}


@pytest.fixture(scope="module")
def gpt_small():
    return fxacct.profile(config("GPT", batch=2))


def _forward_ops(p, target):
    return [n for n in p.capture.graph.nodes
            if n.op == "call_function" and n.target is target and n.meta["fxacct"].phase == "forward"]


def test_gpt_linear_nodes_carry_their_module(gpt_small):
    addmm = _forward_ops(gpt_small, torch.ops.aten.addmm.default)
    # 2 layers × (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    assert len(addmm) == 8
    modules = [n.meta["fxacct"].module for n in addmm]
    assert all(m.rpartition(".")[2] in ("c_attn", "c_proj", "c_fc") for m in modules), modules
    assert modules[:4] == ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"]
    (head,) = _forward_ops(gpt_small, torch.ops.aten.mm.default)
    assert head.meta["fxacct"].module == "lm_head"
    sdpa = [n for n in gpt_small.capture.graph.nodes
            if "fxacct" in n.meta and n.meta["fxacct"].phase == "forward" and "scaled_dot_product" in str(n.target)]
    assert [n.meta["fxacct"].module for n in sdpa] == ["h.0.attn", "h.1.attn"]


def test_module_rows_are_inclusive(gpt_small):
    rows = {m.module: m for m in gpt_small.accounting.modules}
    # B·T = 2·32 = 64 rows, n_embd 64. Per block: c_attn (64, 64) @ (64, 192): 2·64·64·192 = 1,572,864;
    # attn.c_proj 2·64·64·64 = 524,288; mlp.c_fc 2·64·64·256 = 2,097,152; mlp.c_proj the same
    # (LayerNorms and residual adds are `other`, SDPA is `attention`)
    attn, mlp = 1_572_864 + 524_288, 2 * 2_097_152
    for i in range(2):
        assert rows[f"h.{i}.attn.c_attn"].forward.matmul == 1_572_864
        assert rows[f"h.{i}.attn"].forward.matmul == attn
        assert rows[f"h.{i}.mlp"].forward.matmul == mlp
        assert rows[f"h.{i}"].forward.matmul == attn + mlp  # inclusive: the block holds both sublayers
    # the root holds both blocks and lm_head, (64, 64) @ (64, 100): 2·64·64·100 = 819,200
    assert rows[""].forward.matmul == 2 * (attn + mlp) + 819_200
    assert rows["h"].forward.matmul == 2 * (attn + mlp)  # a ModuleList never runs, yet holds its blocks


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.alias = self.lin  # the same module under a second name: named_modules() keeps "lin"

    def forward(self, x):
        return self.alias(self.lin(x))


def test_shared_module_keeps_its_one_fqn():
    p = profile_meta(on_meta(Shared), (meta_input(3, 4),))
    addmm = _forward_ops(p, torch.ops.aten.addmm.default)
    assert [n.meta["fxacct"].module for n in addmm] == ["lin", "lin"]
    rows = {m.module: m for m in p.accounting.modules}
    assert "alias" not in rows
    # two calls of (3,4) @ (4,4): 2 · 2·3·4·4 = 192
    assert rows["lin"].forward.matmul == 192


MATMUL_BACKWARD = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                   torch.ops.aten.convolution_backward.default}


@pytest.mark.parametrize("name", ["GPT", "ResNet18", "TransformerLM"])
def test_backward_matmul_nodes_link_to_forward(name):
    p = fxacct.profile(config(name, batch=2))
    backward = [n for n in p.capture.graph.nodes
                if "fxacct" in n.meta and n.meta["fxacct"].phase == "backward"
                and (n.target in MATMUL_BACKWARD or "scaled_dot_product" in str(n.target))]
    assert backward
    for n in backward:
        fwd = n.meta["trace"].derived_from
        assert fwd is not None, n.format_node()
        assert fwd.meta["fxacct"].phase == "forward"
        assert n.meta["fxacct"].owner == fwd.name
        assert n.meta["fxacct"].module == fwd.meta["fxacct"].module
        assert fwd.meta["fxacct"].flops.matmul + fwd.meta["fxacct"].flops.attention > 0, \
            f"{n.target} links to {fwd.target}"


def test_gpt2_default_counts_tied_weights_once():
    p = fxacct.profile(fxacct.Config(target=target("examples/gpt2.py:GPT"), batch=1))  # defaults
    t = p.accounting.totals
    # wte 50257·768 = 38,597,376 (lm_head.weight is the same tensor: counted once)
    # + wpe 1024·768 = 786,432 + 12 blocks × 7,087,872 = 85,054,464 + ln_f 2·768 = 1,536
    # = 124,439,808 (per-block breakdown in tests/test_examples_eager.py)
    assert t.params == 124_439_808
    assert t.trainable_params == 124_439_808
    assert t.param_bytes == 4 * 124_439_808
    assert t.grad_bytes == 4 * 124_439_808
    tied = [pi for pi in p.capture.params if len(pi.names) > 1]
    assert [set(pi.names) for pi in tied] == [{"wte.weight", "lm_head.weight"}]
    assert tied[0].shape == (50257, 768)


# ---------------------------------------------------------------- module types
class LSTMModel(nn.Module):
    def __init__(self, num_layers=2, batch_first=True):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=num_layers, batch_first=batch_first)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y)


class GRUModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 16, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


class MHAModel(nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.need_weights = need_weights
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        y, _ = self.mha(x, x, x, need_weights=self.need_weights)
        return y


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.add_(1.0)  # addmm saves its inputs, not its output: safe to mutate
        h = self.relu(h)
        y = self.b(h)
        y.mul_(2.0)
        return y


class ParamList(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.empty(8, 8)) for _ in range(3)])

    def forward(self, x):
        for w in self.ws:
            x = torch.tanh(x @ w)
        return x


MODELS = {
    "GRU": (GRUModel, (), (2, 5, 8)),
    "MHA-weights": (MHAModel, (True,), (2, 5, 16)),
    "MHA-sdpa": (MHAModel, (False,), (2, 5, 16)),
    "in-place": (InPlace, (), (2, 8)),
    "ParameterList": (ParamList, (), (2, 8)),
    "LSTM": (LSTMModel, (), (2, 5, 8)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_module_types_trace_without_unsupported_ops(name):
    cls, args, shape = MODELS[name]
    p = profile_meta(on_meta(cls, *args), (meta_input(*shape),))
    assert p.accounting.unsupported_ops == {}
    assert p.accounting.totals.forward.matmul > 0 and p.accounting.totals.backward.matmul > 0


@pytest.mark.parametrize("name", [n for n in MODELS if n != "LSTM"])
def test_module_types_match_flop_counter(name):
    cls, args, shape = MODELS[name]
    model = on_meta(cls, *args)
    x = meta_input(*shape)
    t = profile_meta(model, (x,)).accounting.totals
    assert (model_flops(t.forward), model_flops(t.backward)) == flop_counter_oracle(model, (x,))


def test_lstm_forward_matches_flop_counter():
    # 2 layers, I = 8, H = 16, 4 gates (GH = 64), T = 5, B = 2; head Linear(16, 4) over 10 rows
    # layer 0: 2·T·B·GH·(I + H) = 2·5·2·64·24 = 30,720; layer 1: 2·5·2·64·32 = 40,960
    # head: 2·10·16·4 = 1,280; total 72,960
    model = on_meta(LSTMModel)
    x = meta_input(2, 5, 8)
    t = profile_meta(model, (x,)).accounting.totals
    fwd, _ = flop_counter_oracle(model, (x,))
    assert model_flops(t.forward) == fwd == 72_960


# Regression: torch calls mkldnn_rnn_layer with the input already time-major (T, B, I) while still
# passing batch_first=True; fxacct once trusted the flag and costed T=5, B=2 as T=2, B=5.
@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_backward_matches_flop_counter(batch_first):
    # one LSTM layer, I = 8, H = 16, 4 gates (GH = 64), T = 5, B = 2; the input and h0 need no grad.
    # Per step t the cell computes x_t W_ihᵀ and h_{t-1} W_hhᵀ (h_{-1} = 0, a constant). Backward:
    #   dW_ih = Σ_t dgates_tᵀ x_t:        2·T·B·GH·I     = 2·5·2·64·8  = 10,240
    #   dW_hh = Σ_t dgates_tᵀ h_{t-1}:    2·T·B·GH·H     = 2·5·2·64·16 = 20,480
    #   dh_{t-1} = dgates_t W_hh, t ≥ 1:  2·(T-1)·B·GH·H = 2·4·2·64·16 = 16,384 (h_{-1} needs none)
    #   LSTM total 47,104; the frozen head Linear(16, 4) adds only dX: 2·10·4·16 = 1,280
    model = on_meta(LSTMModel, 1, batch_first)
    model.head.requires_grad_(False)
    x = meta_input(2, 5, 8) if batch_first else meta_input(5, 2, 8)
    t = profile_meta(model, (x,), batch=2).accounting.totals
    _, bwd = flop_counter_oracle(model, (x,))
    assert bwd == 47_104 + 1_280
    assert model_flops(t.backward) == bwd


@pytest.mark.parametrize("input_grad", [False, True])
def test_two_layer_lstm_matches_flop_counter(input_grad):
    """Layer 1's input (layer 0's output) needs a gradient: dX is counted there."""
    model = on_meta(LSTMModel, 2, False)
    x = meta_input(5, 2, 8)
    t = profile_meta(model, (x,), batch=2, input_requires_grad=input_grad).accounting.totals
    expected = flop_counter_oracle(model, (x,), input_grads=input_grad)
    assert (model_flops(t.forward), model_flops(t.backward)) == expected


def test_parameter_list_matmuls_run_in_the_callers_module():
    p = profile_meta(on_meta(ParamList), (meta_input(2, 8),))
    mm = [r for r in p.accounting.nodes if r.op == "aten.mm.default"]
    # DESIGN.md: ParameterList items are parameters, so x @ w runs in the list's caller (the root)
    assert [r.module for r in mm] == ["", "", ""]
    assert [r.forward.matmul for r in mm] == [2 * 2 * 8 * 8] * 3


def test_inplace_ops_are_inplace_and_allocate_nothing():
    p = profile_meta(on_meta(InPlace), (meta_input(2, 8),))
    rows = {r.op: r for r in p.accounting.nodes if r.op in ("aten.add_.Tensor", "aten.relu_.default", "aten.mul_.Tensor")}
    assert set(rows) == {"aten.add_.Tensor", "aten.relu_.default", "aten.mul_.Tensor"}
    for r in rows.values():
        assert r.kind == "inplace" and r.output_bytes == 0
        assert r.forward.other == 2 * 8  # one FLOP per element of the (2, 8) tensor
    assert rows["aten.relu_.default"].module == "relu"


# ---------------------------------------------------------------- models eager accepts or rejects
class PlainTensorAttribute(nn.Module):
    """A tensor held as a plain attribute (not a registered buffer): common in user code."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.ones(4)

    def forward(self, x):
        return self.lin(x) * self.scale


# Regression: a tensor held as a plain attribute (not a parameter or buffer) once made
# FakeTensorMode raise 'Please convert all Tensors to FakeTensors first'.
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_plain_tensor_attribute_traces(device):
    with torch.device(device):
        model = PlainTensorAttribute()
    p = profile_meta(model, (meta_input(2, 4),))
    # (2,4) @ (4,4): 2·2·4·4 = 64
    assert p.accounting.totals.forward.matmul == 64


class MutatesSavedTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))  # relu saves its output for backward ...
        h.mul_(2.0)  # ... which is then modified in place: eager backward raises
        return self.b(h)


def test_mutating_a_saved_tensor_fails_in_eager():
    model = MutatesSavedTensor()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 8)).sum().backward()


# Regression: with a saved_tensors_hooks pack hook autograd skips its version check; fxacct's
# unpack makes it, so a model whose eager backward raises fails here too.
def test_mutating_a_saved_tensor_is_a_model_error():
    with pytest.raises(fxacct.ModelError):
        profile_meta(on_meta(MutatesSavedTensor), (meta_input(2, 8),))


def test_an_example_input_that_requires_grad_gets_its_gradient_as_in_eager():
    # a pipeline stage's received activation, or a user's x.requires_grad_(): the traced backward
    # computes dL/dx too, as eager does. Linear(4, 3) on 2 rows: the input gradient is one more mm,
    # (2×3) @ (3×4) = 2·2·3·4 = 48 FLOPs, and one more gradient storage beside the weight's and bias's
    model = nn.Linear(4, 3)
    plain = fxacct.profile_module(model, (torch.randn(2, 4),), {}, fxacct.Config(batch=2))
    wanted = fxacct.profile_module(model, (torch.randn(2, 4, requires_grad=True),), {}, fxacct.Config(batch=2))
    assert wanted.accounting.totals.backward.total - plain.accounting.totals.backward.total == 48
    assert (len(plain.capture.grad_storages), len(wanted.capture.grad_storages)) == (2, 3)
    x = torch.randn(2, 4, requires_grad=True)  # the eager oracle: the same step gives x a gradient
    model(x).sum().backward()
    assert x.grad is not None and x.grad.shape == (2, 4)


@pytest.mark.parametrize("length,fails", [(8, False), (9, True)])
def test_an_embedding_looked_up_past_its_rows_fails_as_in_eager(length, fails):
    """A Hugging Face GPT-2 of 8 learned positions at T = 9: eager raises "index out of range in
    self" at its position embedding; the fake trace accounted the step as if it ran (--seq-len
    past the maximum exited 0). The position ids, arange(T), have known values
    (fxacct.trace.known_values), so the lookup is checked as eager's kernel checks it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8, use_cache=False)
    torch.manual_seed(0)
    eager_fails = False
    try:
        transformers.GPT2LMHeadModel(config)(torch.zeros(1, length, dtype=torch.long))
    except IndexError:
        eager_fails = True
    assert eager_fails == fails
    model = on_meta(transformers.GPT2LMHeadModel, config)
    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    if not fails:
        profile_meta(model, (ids,))
        return
    with pytest.raises(fxacct.ModelError, match="index out of range in self"):
        profile_meta(model, (ids,))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op dispatched while it is on: the eager oracle's."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dedup", (True, False))
def test_backward_detaches_what_eager_detaches(dedup):
    """fxacct's saved-tensor hook made autograd detach every saved tensor it unpacked (a hook's
    tensor comes back through shallow_copy_and_detach, a dispatched aten.detach): an op eager never
    runs for a saved input, an eighth of a transformer step's nodes. Eager detaches a saved output
    only. Oracle: the same model's backward on real CPU tensors, no hook, its ops counted: Tanh and
    Sigmoid save their outputs (2 detaches), the three addmm what their gradients read (none); the
    trace had one per tensor unpacked (6 here). loss.backward()'s AccumulateGrad detaches each
    gradient it stores in .grad (6 more, eager's and the trace's), left out of the graph as fxacct's
    own are (fxacct.trace.dispatch_recorder, _engine_detach)."""
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 4)]
    model, x = nn.Sequential(*blocks), torch.randn(2, 8)
    loss = model(x).float().sum()  # fxacct's default loss, `sum`
    with _Ops() as eager:
        loss.backward()
    expected = eager.ops.count(torch.ops.aten.detach.default) - len(list(model.parameters()))
    assert expected == 2
    p = fxacct.profile_module(model, (x,), {}, fxacct.Config(batch=2, dedup=dedup))
    traced = [n for n in p.capture.graph.nodes
              if n.target is torch.ops.aten.detach.default and n.meta["trace"].phase == "backward"]
    assert len(traced) == expected
    saved_outputs = [n for n in traced if n.args[0].target in (torch.ops.aten.tanh.default, torch.ops.aten.sigmoid.default)]
    assert len(saved_outputs) == 2


def test_an_example_id_past_the_embedding_is_refused_as_eager_refuses_it():
    # eager: IndexError at the lookup of 12 in a 10-row table; on fake tensors the meta kernel has
    # no values, so the example's own largest id (12) is carried to the lookup and checked there
    model = nn.Embedding(10, 4)
    with pytest.raises(IndexError):
        model(torch.tensor([[3, 12]]))
    with pytest.raises(fxacct.errors.ModelError, match="ids up to 12 in an embedding of 10 rows"):
        fxacct.profile_module(model, (torch.tensor([[3, 12]]),))
    fxacct.profile_module(model, (torch.tensor([[3, 9]]),))  # the last row: eager runs it


class _NormBlock(nn.Module):
    """LayerNorm (one op, three outputs, two of them saved), a linear, a residual, and a plain tensor
    attribute (no parameter, no buffer: a constant of the capture) that a multiply saves."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.scale = torch.full((d,), 0.5)

    def forward(self, x):
        return x + self.lin(self.norm(x)) * self.scale


class _NormStack(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 4, classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(_NormBlock(d) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, target):
        return torch.nn.functional.cross_entropy(self.model(x), target)


@pytest.mark.parametrize("dedup", [True, False])
def test_saved_bytes_sit_on_their_first_producers_as_eager_saves_them(dedup):
    """What autograd saves is put on the node that made each storage: inputs and the loss's target
    (placeholders), a tensor attribute (a constant placeholder), LayerNorm's mean and rstd (its op
    node, never the getitems that read them out), replayed blocks' ops alike. Their sum is what a
    real eager forward and loss save (saved-tensor hooks, each storage once, parameters aside)."""
    import operator

    from helpers import eager_saved_bytes

    B, d = 3, 8
    p = profile_meta(on_meta(_NormStack), (meta_input(B, d),), loss="cross-entropy", dedup=dedup)
    nodes = list(p.capture.graph.nodes)
    getitems = [n for n in nodes if n.target is operator.getitem]
    assert getitems and all(n.meta["trace"].saved == () for n in getitems)
    saved = {n: n.meta["trace"].saved for n in nodes if "trace" in n.meta and n.target is not operator.getitem}
    norms = [n for n in saved if n.target is torch.ops.aten.native_layer_norm.default and n.meta["trace"].phase == "forward"]
    assert len(norms) == 4 and all(len(saved[n]) == 3 for n in norms)  # its output (the linear saves it), mean, rstd
    torch.manual_seed(0)
    real = _WithLoss(_NormStack())
    total, _ = eager_saved_bytes(real, (torch.randn(B, d), torch.randint(0, 5, (B,))))
    assert sum(b for s in saved.values() for b, _ in s) == total == p.accounting.totals.activation_bytes
    scales = [n for n in saved if n.op == "placeholder" and n.name.startswith("constant") and n.meta["val"].shape == (d,)]
    assert len(scales) == 4 and all(saved[n] == ((4 * d, torch.float32),) for n in scales)  # saved by each multiply
    assert saved[next(n for n in nodes if n.name == "target")]  # nll_loss saves its target


class _ModeWitness(nn.Module):
    """A block whose forward notes the torch-function modes in force when it runs."""

    seen: list[int] = []

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        from fxacct.trace import torch_private as tp

        _ModeWitness.seen.append(len(tp.function_mode_stack()))
        return torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])[0] + self.lin(x)


@pytest.mark.parametrize("gpu", [None, "h100"])
def test_the_models_code_runs_under_the_captures_function_modes_when_blocks_replay(gpu):
    """fxacct's own bookkeeping turns the capture's torch-function modes off (its metadata reads);
    the model's code never runs without them: each block forward that runs (the probes and the
    inference capture's traced blocks) sees the attention scope (and, for a GPU, the CUDA kernel
    rules), so the attention FLOPs of every block, replayed or not, equal tracing every block's."""
    _ModeWitness.seen = []
    model = on_meta(lambda: nn.Sequential(*[_ModeWitness(8) for _ in range(5)]))
    replayed = profile_meta(model, (meta_input(6, 8),), gpu=gpu)
    want = 2 if gpu else 1
    assert _ModeWitness.seen and min(_ModeWitness.seen) >= want
    assert len(_ModeWitness.seen) < 10  # blocks replayed: fewer forwards than 5 (train) + 5 (inference)
    traced = profile_meta(model, (meta_input(6, 8),), gpu=gpu, dedup=False)
    assert replayed.accounting.totals.forward.attention == traced.accounting.totals.forward.attention > 0
    assert replayed.accounting.totals == traced.accounting.totals
