"""The formula tier: every registered cost formula against a number computed outside fxacct.

- `other`-class composites (softmax, norms, losses, dropout, embedding gradient, RNN cells) against
  torch's own decomposition of the op, lowered to core ATen and counted under fxacct's family rules
  (1 FLOP per output element of a pointwise op, 1 per input element of a reduction; views, copies,
  creation and integer/boolean index bookkeeping are not floating-point work);
- matmul / convolution against torch.utils.flop_counter.FlopCounterMode on meta tensors, attention
  against flop_counter's own SDPA formulas;
- conventions (pooling windows, scans, scatters, fused bias adds, transcendentals = 1 FLOP) and
  gradient-mask subsets by hand arithmetic, each with its reason in a comment.

A last test checks that every registry key is hit by at least one case here.
"""

import math

import pytest
import torch
from helpers import target
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import fxacct
from fxacct.costs import registry
from fxacct.costs.registry import ZERO, CostContext, Flops, lookup

aten = torch.ops.aten
prims = torch.ops.prims
HIT: set = set()  # registry keys the cases below reach (checked by the last test)


def _key(op):
    """The registry key lookup() resolves op to (overload, packet, tag family or foreach)."""
    if op in registry._REGISTRY:
        return op
    if getattr(op, "overloadpacket", None) in registry._REGISTRY:
        return op.overloadpacket
    info = lookup(op)
    return next(k for k, v in registry._REGISTRY.items() if v is info)


def _shapes(a):
    if isinstance(a, torch.Tensor):
        return tuple(a.shape)
    if isinstance(a, (list, tuple)):
        return type(a)(_shapes(x) for x in a)
    return a


def fx_cost(op, args, kwargs=None, out=None, grad_mask=None, causal="full") -> Flops:
    """Cost op the way fxacct.account.annotate does: tensors replaced by shapes."""
    kwargs = kwargs or {}
    if out is None:
        out = op(*args, **kwargs)
    info = lookup(op)
    assert info is not None, op
    HIT.add(_key(op))
    ctx = CostContext(causal, grad_mask, op)
    return info.formula(*_shapes(args), out_shape=_shapes(out), ctx=ctx, **_shapes(kwargs))


# ---- the decomposition oracle -------------------------------------------------------------------

_OWN = {k for k, i in registry._REGISTRY.items() if not isinstance(k, (str, torch.Tag))
        and not (i.movement or i.creation)}
# core ATen decompositions, plus torch's decomposition of every op fxacct costs as a composite
# (those are core ops themselves: _softmax, native_layer_norm...); addmm keeps fxacct's
# convention (product in `matmul`, bias add 1 per output, pinned in test_addmm_bias_convention)
_TABLE = dict(core_aten_decompositions())
# addcmul(a, b, c) = a + b · c is one pointwise op, as its kernel is, not three: torch 2.15's
# native_group_norm_backward writes 2.14's db · mean - ds (mul, sub) as addcmul(-ds, db, mean) (neg,
# addcmul), the same count only if addcmul stays whole (torch/_decomp/decompositions.py)
_TABLE = {op: fn for op, fn in _TABLE.items() if getattr(op, "overloadpacket", op) is not aten.addcmul}
_TABLE.update({op: fn for op, fn in decomposition_table.items()
               if isinstance(op, torch._ops.OpOverload) and op.overloadpacket is not aten.addmm
               and (op in _OWN or op.overloadpacket in _OWN)})
_NO_FLOPS = {aten.clone.default, aten._to_copy.default, aten.copy_.default, aten.full.default,
             aten.full_like.default, aten.scalar_tensor.default, aten.rand_like.default,
             aten.arange.start_step, aten.gather.default, aten.scatter.value, aten.index.Tensor,
             aten.constant_pad_nd.default, aten.empty_strided.default, aten.empty_like.default,
             aten.zeros_like.default, aten.ones_like.default, prims.empty_strided.default,
             prims.copy_to.default, aten.mm.default, aten.cat.default}


def _tensors(v):
    return [x for x in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(x, torch.Tensor)]


def _node_flops(node) -> int:
    op = node.target
    ins = [t for a in node.all_input_nodes for t in _tensors(a.meta.get("val"))]
    outs = _tensors(node.meta.get("val"))
    floating = any(t.is_floating_point() for t in ins + outs)
    schema = op._schema
    if op in _NO_FLOPS or (schema.returns and schema.returns[0].alias_info and not schema.is_mutable):
        return 0  # copies, creation, views
    if op is aten.index_put.default:  # accumulate=True adds each value once
        return node.args[2].meta["val"].numel() if len(node.args) > 3 and node.args[3] else 0
    if op is aten.addmm.default:  # the fused bias add, fxacct's convention
        return outs[0].numel()
    if torch.Tag.pointwise in op.tags:
        return outs[0].numel() if floating else 0
    if torch.Tag.reduction in op.tags:
        return ins[0].numel() if floating else 0
    raise AssertionError(f"the decomposition emitted {op}, which no counting rule covers")


def _spelling(node) -> bool:
    """Whether a node is no arithmetic of its own, only the way a release wrote the formula, so that
    the count does not depend on how torch spells the same arithmetic:
    - x · 1: ``1 / t`` decomposes to reciprocal(t) · 1 (batch norm's eval invstd up to torch 2.14);
    - reciprocal(sqrt(x)) is one rsqrt: torch 2.14 writes batch norm's eval invstd as
      1 / sqrt(v + eps), 2.15 as rsqrt(v + eps) (torch/_decomp/decompositions.py,
      native_batch_norm_helper).
    (2.15's group norm backward writes 2.14's db · mean - ds as addcmul(-ds, db, mean): addcmul is
    kept whole, see _TABLE.)"""
    op, args = node.target, node.args
    if op is aten.mul.Tensor:
        return any(isinstance(a, (int, float)) and not isinstance(a, bool) and a == 1 for a in args)
    if op is aten.reciprocal.default:
        return isinstance(args[0], torch.fx.Node) and args[0].target is aten.sqrt.default
    return False


def decomposed_flops(fn, *args) -> int:
    """FLOPs of fn's ops after torch's decomposition; ops whose results are unused are dropped,
    and so are the ones that only spell a formula another release writes differently."""
    gm = make_fx(fn, decomposition_table=_TABLE)(*args)
    gm.graph.eliminate_dead_code()
    return sum(_node_flops(n) for n in gm.graph.nodes
               if n.op == "call_function" and n.target.__name__ != "getitem" and not _spelling(n))


def _masked(outputs, mask):
    return tuple(o for o, m in zip(outputs, mask) if m)


r = torch.randn
X2 = r(4, 6)  # rows = 4, normalized size 6
X3 = r(2, 5, 3)
W6, B6 = r(6), r(6)
XC = r(2, 3, 4, 4)  # N = 2, C = 3
C3, B3, RM, RV = r(3), r(3), r(3), r(3).abs() + 0.5
XG = r(2, 6, 3, 3)  # group norm: N = 2, C = 6, HxW = 9, 3 groups
TGT = torch.tensor([1, 0, 5, 2])
EMB_IDX = torch.tensor([1, 0, 5, 2, 2])


def _softmax_cases():
    y = torch.softmax(X3, 1)
    yield "softmax", aten._softmax.default, (X3, 1, False), None
    yield "log_softmax", aten._log_softmax.default, (X3, 1, False), None
    yield "log_softmax_last", aten._log_softmax.default, (X2, -1, False), None
    yield "safe_softmax", aten._safe_softmax.default, (X3, -1), None
    yield "softmax_bwd", aten._softmax_backward_data.default, (r(2, 5, 3), y, 1, torch.float32), None
    yield ("log_softmax_bwd", aten._log_softmax_backward_data.default,
           (r(2, 5, 3), y.log(), 1, torch.float32), None)


def _layer_norm_cases():
    x = r(3, 4, 6)
    for w, b in ((W6, B6), (None, None), (W6, None)):
        yield (f"layer_norm w={w is not None} b={b is not None}", aten.native_layer_norm.default,
               (x, [6], w, b, 1e-5), None)
    _, mean, rstd = aten.native_layer_norm(x, [6], W6, B6, 1e-5)
    for m in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)):
        m = [bool(i) for i in m]
        for w, b in ((W6, B6), (None, None))[:1 + (m == [True, False, False])]:
            yield (f"layer_norm_bwd {m} w={w is not None}", aten.native_layer_norm_backward.default,
                   (r(3, 4, 6), x, [6], mean, rstd, w, b, m), m)
    yield "layer_norm 2d stats", aten.native_layer_norm.default, (x, [4, 6], r(4, 6), None, 1e-5), None


def _rms_norm_cases():
    x = r(3, 4, 6)
    for w in (W6, None):
        yield f"rms_norm w={w is not None}", aten._fused_rms_norm.default, (x, [6], w, 1e-5), None
    _, rstd = aten._fused_rms_norm(x, [6], W6, 1e-5)
    for m in ((1, 1), (1, 0), (0, 1)):
        m = [bool(i) for i in m]
        for w in (W6, None):
            yield (f"rms_norm_bwd {m} w={w is not None}", aten._fused_rms_norm_backward.default,
                   (r(3, 4, 6), x, [6], rstd, w, m), m)


def _batch_norm_cases():
    for tr in (True, False):
        for w, b in ((C3, B3), (None, None), (C3, None)):
            tag = f"train={tr} w={w is not None} b={b is not None}"
            args = (XC, w, b, RM.clone(), RV.clone(), tr, 0.1, 1e-5)
            yield f"bn {tag}", aten.native_batch_norm.default, args, None
            yield f"legit {tag}", aten._native_batch_norm_legit.default, args, None
            yield f"functional {tag}", aten._native_batch_norm_legit_functional.default, args, None
        yield f"cudnn train={tr}", aten.cudnn_batch_norm.default, (XC, C3, B3, RM, RV, tr, 0.1, 1e-5), None
    yield "bn no stats", aten.native_batch_norm.default, (XC, C3, B3, None, None, True, 0.1, 1e-5), None
    yield "legit no_stats", aten._native_batch_norm_legit.no_stats, (XC, C3, None, True, 0.1, 1e-5), None
    no_training = aten._native_batch_norm_legit_no_training.default
    yield "no_training", no_training, (XC, C3, B3, RM, RV, 0.1, 1e-5), None
    yield "no_training nw", no_training, (XC, None, None, RM, RV, 0.1, 1e-5), None
    _, sm, si = aten.native_batch_norm(XC, C3, B3, RM.clone(), RV.clone(), True, 0.1, 1e-5)
    for tr in (True, False):
        for m in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
            m = [bool(i) for i in m]
            yield (f"bn_bwd train={tr} {m}", aten.native_batch_norm_backward.default,
                   (r(2, 3, 4, 4), XC, C3, RM, RV, sm, si, tr, 1e-5, m), m)


def _group_norm_cases():
    for w, b in ((r(6), r(6)), (None, None), (r(6), None), (None, r(6))):
        yield (f"gn w={w is not None} b={b is not None}", aten.native_group_norm.default,
               (XG, w, b, 2, 6, 9, 3, 1e-5), None)
    _, mean, rstd = aten.native_group_norm(XG, W6, B6, 2, 6, 9, 3, 1e-5)
    for m in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
        m = [bool(i) for i in m]
        for w in (W6, None):
            yield (f"gn_bwd {m} w={w is not None}", aten.native_group_norm_backward.default,
                   (r(2, 6, 3, 3), XG, mean, rstd, w, 2, 6, 9, 3, m), m)


def _loss_cases():
    lx, lx2d = torch.log_softmax(X2, -1), torch.log_softmax(r(2, 6, 3, 3), 1)
    t2d = torch.randint(0, 6, (2, 3, 3))
    for red in (0, 1, 2):
        g = r(4) if red == 0 else torch.tensor(1.0)
        for w in (None, W6):
            yield (f"nll red={red} w={w is not None}", aten.nll_loss_forward.default,
                   (lx, TGT, w, red, -100), None)
            yield (f"nll_bwd red={red} w={w is not None}", aten.nll_loss_backward.default,
                   (g, lx, TGT, w, red, -100, torch.tensor(4.0)), None)
        yield f"nll2d red={red}", aten.nll_loss2d_forward.default, (lx2d, t2d, None, red, -100), None
        g2 = r(2, 3, 3) if red == 0 else torch.tensor(1.0)
        yield (f"nll2d_bwd red={red}", aten.nll_loss2d_backward.default,
               (g2, lx2d, t2d, W6, red, -100, torch.tensor(18.0)), None)
        yield f"mse red={red}", aten.mse_loss.default, (X2, r(4, 6), red), None
        gm = r(4, 6) if red == 0 else torch.tensor(1.0)
        yield f"mse_bwd red={red}", aten.mse_loss_backward.default, (gm, X2, r(4, 6), red), None
        for w, pw in ((None, None), (W6, None), (None, W6), (W6, W6)):
            yield (f"bce red={red} w={w is not None} pw={pw is not None}",
                   aten.binary_cross_entropy_with_logits.default, (X2, X2.sigmoid(), w, pw, red), None)
    yield "dropout", aten.native_dropout.default, (X2, 0.25, True), None
    yield "dropout eval", aten.native_dropout.default, (X2, 0.25, False), None
    yield "dropout p=0", aten.native_dropout.default, (X2, 0.0, True), None
    yield "dropout p=1", aten.native_dropout.default, (X2, 1.0, True), None
    for scale in (False, True):
        yield (f"embedding_bwd scale={scale}", aten.embedding_dense_backward.default,
               (r(5, 6), EMB_IDX, 10, -1, scale), None)


DECOMP_CASES = [c for gen in (_softmax_cases, _layer_norm_cases, _rms_norm_cases, _batch_norm_cases,
                              _group_norm_cases, _loss_cases) for c in gen()]


@pytest.mark.parametrize("case", DECOMP_CASES, ids=[c[0] for c in DECOMP_CASES])
def test_composite_equals_torch_decomposition(case):
    _, op, args, mask = case

    def fn(*a):
        res = op(*a)
        return _masked(res, mask) if mask is not None else res

    expected = decomposed_flops(fn, *args)
    got = fx_cost(op, args, out=())  # these formulas read input shapes only
    assert (got.matmul, got.attention, got.other) == (0, 0, expected)


@pytest.mark.parametrize("gates,cell", [(4, torch.lstm_cell), (3, torch.gru_cell), (1, torch.rnn_tanh_cell)])
@pytest.mark.parametrize("biases", [True, False])
def test_rnn_layer_elementwise_equals_torch_cell(gates, cell, biases):
    # mkldnn_rnn_layer per step = torch's own cell (lstm_cell / gru_cell / rnn_tanh_cell):
    # `other` from its decomposition (bias adds 1 per output, as addmm), `matmul` from flop_counter
    t, b, i, h = 3, 2, 5, 4
    tensors = (r(b, i), r(b, h), r(b, h), r(gates * h, i), r(gates * h, h))
    tensors += (r(gates * h), r(gates * h)) if biases else ()

    def step(x, hx, cx, w_ih, w_hh, *bias):
        return cell(x, (hx, cx) if gates == 4 else hx, w_ih, w_hh, *bias)

    with FlopCounterMode(display=False) as fc:
        step(*tensors)
    shapes = ((t, b, i), (gates * h, i), (gates * h, h), (gates * h,), (gates * h,), (1, b, h),
              (1, b, h), False, [], 2, h, 1, biases, False, False, True)
    got = _cost_shapes(aten.mkldnn_rnn_layer.default, shapes)
    assert got == Flops(matmul=t * fc.get_total_flops(), other=t * decomposed_flops(step, *tensors))


# ---- matmul and convolution against FlopCounterMode on meta tensors ---------------------------

def _meta(*shape):
    return torch.empty(*shape, device="meta")


def _flop_counter(op, args) -> int:
    with FlopCounterMode(display=False) as fc:
        op(*args)
    return fc.get_total_flops()


CONV = [  # (x, w, stride, padding, dilation, transposed, output_padding, groups)
    ((2, 4, 9, 9), (6, 4, 3, 3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ((2, 4, 9, 9), (6, 2, 3, 3), [2, 2], [0, 0], [1, 1], False, [0, 0], 2),  # grouped, strided
    ((2, 4, 5, 7), (4, 3, 3, 2), [2, 1], [1, 0], [1, 1], True, [1, 0], 1),  # transposed
    ((2, 4, 5, 5), (4, 2, 3, 3), [1, 1], [0, 0], [1, 1], True, [0, 0], 2),  # transposed, grouped
    ((2, 3, 10), (5, 3, 4), [1], [2], [2], False, [0], 1),  # 1-d, dilated
    ((1, 2, 4, 5, 6), (3, 2, 2, 3, 2), [1, 1, 1], [0, 1, 0], [1, 1, 1], False, [0, 0, 0], 1),  # 3-d
]


@pytest.mark.parametrize("op,shapes", [
    (aten.mm.default, [(3, 5), (5, 7)]), (aten.bmm.default, [(2, 3, 5), (2, 5, 7)]),
    (aten.addmm.default, [(7,), (3, 5), (5, 7)]), (aten.baddbmm.default, [(2, 3, 7), (2, 3, 5), (2, 5, 7)]),
])
def test_matmul_family_equals_flop_counter(op, shapes):
    args = [_meta(*s) for s in shapes]
    got = fx_cost(op, args)
    assert got.matmul == _flop_counter(op, args)
    # the fused bias add (addmm/baddbmm): a convention, 1 add per output element in `other`
    assert got.other == (0 if len(shapes) == 2 else torch.Size(op(*args).shape).numel())


# each vector or accumulating form against FlopCounterMode on the mm/bmm it equals (which counts
# the form itself as 0): (op, its arguments, the same product as mm/bmm arguments, bias adds)
M, K, N, NB = 6, 5, 4, 3
VECTOR_FORMS = {
    "mv": (aten.mv.default, [(M, K), (K,)], aten.mm.default, [(M, K), (K, 1)], 0),
    "dot": (aten.dot.default, [(K,), (K,)], aten.mm.default, [(1, K), (K, 1)], 0),
    "vdot": (aten.vdot.default, [(K,), (K,)], aten.mm.default, [(1, K), (K, 1)], 0),
    "addmv": (aten.addmv.default, [(M,), (M, K), (K,)], aten.mm.default, [(M, K), (K, 1)], M),
    "addr": (aten.addr.default, [(M, N), (M,), (N,)], aten.mm.default, [(M, 1), (1, N)], M * N),
    "addbmm": (aten.addbmm.default, [(M, N), (NB, M, K), (NB, K, N)], aten.bmm.default,
               [(NB, M, K), (NB, K, N)], M * N),
}


@pytest.mark.parametrize("form", list(VECTOR_FORMS))
def test_vector_and_accumulating_products_are_the_mm_they_equal(form):
    op, shapes, same, same_shapes, bias_adds = VECTOR_FORMS[form]
    got = fx_cost(op, [_meta(*s) for s in shapes])
    assert got == Flops(matmul=_flop_counter(same, [_meta(*s) for s in same_shapes]), other=bias_adds)
    assert _flop_counter(op, [_meta(*s) for s in shapes]) == 0  # the gap conventions.md names


@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_equals_flop_counter(bias):
    # fp8 (64, 32) @ (32, 48), the second column-major as the kernel wants: 2·64·32·48 = 196,608
    with FakeTensorMode():
        a = torch.empty(64, 32, dtype=torch.float8_e4m3fn)
        b = torch.empty(48, 32, dtype=torch.float8_e4m3fn).t()
        one = torch.ones((), dtype=torch.float32)
        kwargs = {"bias": torch.empty(48, dtype=torch.bfloat16)} if bias else {}
        args = (a, b, one, one)
        got = fx_cost(aten._scaled_mm.default, args, dict(kwargs, out_dtype=torch.bfloat16))
        with FlopCounterMode(display=False) as fc:
            aten._scaled_mm.default(*args, out_dtype=torch.bfloat16, **kwargs)
    assert got.matmul == fc.get_total_flops() == 196_608
    assert got.other == (64 * 48 if bias else 0)  # the fused bias: one add per output, as addmm


def _per_group_products(layout: str, a, b, ends):
    """aten._grouped_mm spelled as one plain matmul per group (the meaning its docs give)."""
    starts = [0] + ends[:-1]
    cuts = list(zip(starts, ends))
    if layout == "2d-3d":  # rows of a cut by offs, group g times b[g]
        return [(a[s:e], b[g]) for g, (s, e) in enumerate(cuts)]
    if layout == "3d-2d":  # columns of b cut by offs, a[g] times them
        return [(a[g], b[:, s:e]) for g, (s, e) in enumerate(cuts)]
    if layout == "2d-2d":  # the contraction K cut by offs
        return [(a[:, s:e], b[s:e]) for s, e in cuts]
    return [(a[g], b[g]) for g in range(a.shape[0])]  # 3d-3d: a batched product


GROUPED = {  # layout: (a, b) shapes, 3 groups cut at 4, 8, 12 (offs)
    "2d-3d": ((12, 8), (3, 8, 16)), "3d-2d": ((3, 5, 8), (8, 12)),
    "2d-2d": ((5, 12), (12, 16)), "3d-3d": ((3, 5, 8), (3, 8, 16)),
}


@pytest.mark.parametrize("layout", list(GROUPED))
def test_grouped_mm_equals_one_matmul_per_group(layout):
    # MoE experts (transformers' default grouped_mm experts): the oracle is FlopCounterMode over the
    # per-group products, each checked to compute what the CPU kernel computes
    a_shape, b_shape = GROUPED[layout]
    torch.manual_seed(0)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    ends = [4, 8, 12]
    offs = torch.tensor(ends, dtype=torch.int32) if layout != "3d-3d" else None
    out = aten._grouped_mm.default(a, b, offs)
    pieces = _per_group_products(layout, a, b, ends)
    products = [x @ y for x, y in pieces]
    if layout == "2d-3d":
        expected_out = torch.cat(products)
    elif layout == "3d-2d":
        expected_out = torch.cat(products, dim=1)
    else:
        expected_out = torch.stack(products)
    torch.testing.assert_close(out, expected_out)
    with FlopCounterMode(display=False) as fc:
        for x, y in pieces:
            torch.mm(x, y)
    got = fx_cost(aten._grouped_mm.default, (a, b, offs), out=out)
    assert got == Flops(matmul=fc.get_total_flops())
    # by hand: 2d-3d 2·12·16·8 = 3072; 3d-2d 2·5·12·8 = 960; 2d-2d and 3d-3d 2·3·5·16·4 or 2·3·5·16·8
    assert got.matmul == {"2d-3d": 3072, "3d-2d": 960, "2d-2d": 1920, "3d-3d": 3840}[layout]


def test_grouped_mm_bias_and_scaled_variant():
    # a fused bias adds 1 per output element (as addmm); _scaled_grouped_mm (fp8 MoE) has the same
    # products; shapes as the 2d-3d layout above: 12·16 = 192 outputs
    ctx = CostContext(op=aten._grouped_mm.default)
    f = lookup(aten._grouped_mm.default).formula
    assert f((12, 8), (3, 8, 16), (3,), (3, 16), out_shape=(12, 16), ctx=ctx) == Flops(matmul=3072, other=192)
    assert f((12, 8), (3, 8, 16), (3,), None, out_shape=(12, 16), ctx=ctx) == Flops(matmul=3072)
    op = aten._scaled_grouped_mm.default
    scaled = lookup(op).formula((12, 8), (3, 8, 16), (12,), (3, 16), (3,), out_shape=(12, 16), ctx=CostContext(op=op))
    assert scaled == Flops(matmul=3072)
    HIT.add(_key(op))


@pytest.mark.parametrize("conv", CONV, ids=range(len(CONV)))
@pytest.mark.parametrize("op", [aten.convolution.default, aten._convolution.default])
@pytest.mark.parametrize("bias", [True, False])
def test_convolution_equals_flop_counter(conv, op, bias):
    x, w, stride, pad, dil, transposed, out_pad, groups = conv
    c_out = w[1] * groups if transposed else w[0]
    args = [_meta(*x), _meta(*w), _meta(c_out) if bias else None, stride, pad, dil, transposed,
            out_pad, groups]
    if op is aten._convolution.default:
        args += [False, False, True, True]  # benchmark, deterministic, cudnn_enabled, allow_tf32
    out = op(*args)
    got = fx_cost(op, args, out=out)
    assert got.matmul == _flop_counter(op, args)
    assert got.other == (out.numel() if bias else 0)  # the bias add, 1 per output element


@pytest.mark.parametrize("conv", CONV, ids=range(len(CONV)))
@pytest.mark.parametrize("mask", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)])
def test_convolution_backward(conv, mask):
    x, w, stride, pad, dil, transposed, out_pad, groups = conv
    fwd = [_meta(*x), _meta(*w), None, stride, pad, dil, transposed, out_pad, groups]
    out = aten.convolution(*fwd)
    mask = [bool(m) for m in mask]
    args = [_meta(*out.shape), fwd[0], fwd[1], [out.shape[1]], stride, pad, dil, transposed, out_pad,
            groups, mask]
    got = fx_cost(aten.convolution_backward.default, args, out=(None, None, None))
    oracle = _flop_counter(aten.convolution_backward.default, args)
    forward = _flop_counter(aten.convolution.default, fwd)
    if mask[1] and groups > 1:
        # flop_counter overcounts a grouped grad_weight by the group count (its channel-swapped
        # formulation); the weight gradient pairs the same (input, tap, output) triples as the
        # forward: exactly the forward's multiply-adds
        oracle = oracle - forward * groups + forward
    assert got.matmul == oracle
    assert got.other == (out.numel() if mask[2] else 0)  # grad_bias: a sum over grad_out


# ---- attention --------------------------------------------------------------------------------

B, H, TQ, TK, D, DV = 2, 3, 5, 7, 4, 6
_MATH = flop_registry[aten._scaled_dot_product_flash_attention]
_MATH_BWD = flop_registry[aten._scaled_dot_product_flash_attention_backward]
Q, K, V, O = (B, H, TQ, D), (B, H, TK, D), (B, H, TK, DV), (B, H, TQ, DV)
SDPA_FWD = [aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_fused_attention_overrideable.default]
SDPA_BWD = [aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            aten._scaled_dot_product_flash_attention_backward.default,
            aten._scaled_dot_product_efficient_attention_backward.default,
            aten._scaled_dot_product_cudnn_attention_backward.default,
            aten._scaled_dot_product_fused_attention_overrideable_backward.default]


def _cost_shapes(op, shapes, grad_mask=None, causal="full", kwargs=None) -> Flops:
    HIT.add(_key(op))
    return lookup(op).formula(*shapes, out_shape=(), ctx=CostContext(causal, grad_mask, op), **(kwargs or {}))


@pytest.mark.parametrize("op", SDPA_FWD)
def test_sdpa_forward_equals_flop_counter(op):
    # flop_counter has no formula for the CPU and overrideable kernels: the math is the same
    oracle = flop_registry.get(op.overloadpacket, _MATH)(Q, K, V, None)
    assert _cost_shapes(op, (Q, K, V)) == Flops(attention=oracle)


@pytest.mark.parametrize("op", SDPA_BWD)
def test_sdpa_backward_equals_flop_counter(op):
    # flop_counter's backward recomputes S = Q Kᵀ (2·BH·Tq·Tk·d); fxacct counts model FLOPs
    # without recompute (its documented convention), so that one product is taken off
    oracle = _MATH_BWD(O, Q, K, V) - 2 * B * H * TQ * TK * D
    assert _cost_shapes(op, (O, Q, K, V)) == Flops(attention=oracle)


def test_bthd_kernels_equal_flop_counter():
    # (B, T, H, d) layout; flop_counter's own formulas for these kernels need real cum_seq tensors,
    # so the oracle is its dense formula on the same sizes in (B, H, T, d)
    q, k, v, o = (B, TQ, H, D), (B, TK, H, D), (B, TK, H, DV), (B, TQ, H, DV)
    for op in (aten._flash_attention_forward.default, aten._efficient_attention_forward.default):
        assert _cost_shapes(op, (q, k, v)) == Flops(attention=_MATH(Q, K, V))
    for op in (aten._flash_attention_backward.default, aten._efficient_attention_backward.default):
        oracle = _MATH_BWD(O, Q, K, V) - 2 * B * H * TQ * TK * D  # without the recompute of Q Kᵀ
        assert _cost_shapes(op, (o, q, k, v)) == Flops(attention=oracle)


@pytest.mark.parametrize("op", SDPA_BWD + [aten._flash_attention_backward.default,
                                            aten._efficient_attention_backward.default])
@pytest.mark.parametrize("mask", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (0, 0, 0),
                                  (1, 1, 1, 0)])
def test_attention_backward_counts_only_required_gradients(op, mask):
    bthd = op.overloadpacket in (aten._flash_attention_backward, aten._efficient_attention_backward)
    q, k, v, o = ((B, TQ, H, D), (B, TK, H, D), (B, TK, H, DV), (B, TQ, H, DV)) if bthd else (Q, K, V, O)
    need_q, need_k, need_v = mask[:3]
    per = 2 * B * H * TQ * TK  # one multiply-add per (query, key) pair and feature
    expected = (per * DV if need_v else 0)  # dV = Pᵀ dO
    expected += per * DV if need_q or need_k else 0  # dP = dO Vᵀ
    expected += (per * D if need_q else 0) + (per * D if need_k else 0)  # dQ = dS K, dK = dSᵀ Q
    # a 4th entry (the attention mask's requires_grad) must not shift which of q/k/v is read
    grad_mask = tuple(bool(m) for m in mask) + ((True,) if len(mask) == 3 else ())
    assert _cost_shapes(op, (o, q, k, v), grad_mask) == Flops(attention=expected)


def test_causal_halving_reads_the_flag_by_name():
    full = 2 * B * H * TQ * TK * (D + DV)  # Q Kᵀ and P V
    cpu = aten._scaled_dot_product_flash_attention_for_cpu.default  # (q, k, v, dropout_p, is_causal)
    assert _cost_shapes(cpu, (Q, K, V, 0.0, True), causal="halved").attention == full // 2
    assert _cost_shapes(cpu, (Q, K, V, 0.0, True)).attention == full  # the default counts all pairs
    assert _cost_shapes(cpu, (Q, K, V, 0.0, False), causal="halved").attention == full
    assert _cost_shapes(cpu, (Q, K, V), causal="halved", kwargs={"is_causal": True}).attention == full // 2
    eff = aten._efficient_attention_forward.default  # custom_mask_type is its 10th argument
    q, k, v = (B, TQ, H, D), (B, TK, H, D), (B, TK, H, DV)
    for mask_type, causal in ((0, False), (1, True), (2, True)):
        args = (q, k, v, None, None, None, None, None, 0.0, mask_type)
        assert _cost_shapes(eff, args, causal="halved").attention == (full // 2 if causal else full)
    bwd = aten._scaled_dot_product_efficient_attention_backward.default  # is_causal is 12th
    args = (O, Q, K, V, None, O, (B, H, TQ), (), (), 0.0, [True] * 4, True)
    assert _cost_shapes(bwd, args, causal="halved").attention == 2 * full // 2


# ---- conventions, pinned by hand arithmetic ---------------------------------------------------

def _numel(shape):
    return torch.Size(shape).numel()


@pytest.mark.parametrize("op,x,kernel,window", [
    (aten.max_pool2d_with_indices.default, (2, 3, 8, 9), [3, 2], 6),
    (aten.max_pool2d_with_indices.default, (2, 3, 8, 9), [2], 4),  # one value: a 2×2 window
    (aten.avg_pool2d.default, (2, 3, 8, 9), [3, 2], 6),
    (aten.max_pool3d_with_indices.default, (1, 2, 6, 6, 6), [2], 8),
    (aten.avg_pool3d.default, (1, 2, 6, 6, 6), [2, 3, 2], 12),
])
def test_pooling_is_one_op_per_window_element(op, x, kernel, window):
    # convention: max = window compares, avg = window adds (its divide folded in, as a mean's is)
    # per output element; the max-pool decomposition's only floating-point op is that amax
    args = [_meta(*x), kernel, [1]]
    out = op(*args)
    first = out[0] if isinstance(out, tuple) else out
    assert fx_cost(op, args, out=out) == Flops(other=first.numel() * window)


def test_pooling_backward_and_adaptive_pooling():
    x, g = (2, 3, 8, 8), (2, 3, 4, 4)
    for op, window in ((aten.avg_pool2d_backward.default, 4), (aten.avg_pool3d_backward.default, 8)):
        # each gradient element spread over its window (a single kernel value means every dim)
        assert _cost_shapes(op, (g, x, [2])) == Flops(other=_numel(g) * window)
    for op in (aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default):
        assert _cost_shapes(op, (g, x, [2])) == Flops(other=_numel(g))  # one add per grad element
    for op in (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
               aten.adaptive_max_pool2d.default):
        assert _cost_shapes(op, (x, [4, 4])) == Flops(other=_numel(x))  # every input read once
    for op in (aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default,
               aten.adaptive_max_pool2d_backward.default):
        HIT.add(_key(op))
        got = lookup(op).formula(g, x, out_shape=x, ctx=CostContext(op=op))
        assert got == Flops(other=_numel(x))  # one write-add per grad_input element


def test_scans_scatters_and_embedding_bags():
    x = (4, 6)
    for op in (aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default):
        # convention: a scan is n - 1 ≈ n ops; torch's cumsum decomposition is a quadratic masked
        # sum for compilers, not the scan the kernel runs
        assert _cost_shapes(op, (x, 1)) == Flops(other=24)
    src = (3, 6)
    for op, args in ((aten.index_add.default, (x, 0, (3,), src)),
                     (aten.scatter_add.default, (x, 0, src, src)),
                     (aten.scatter_reduce.two, (x, 0, src, src, "sum")),
                     (aten.index_put.default, (x, [(3,)], src, True)),
                     (aten.index_put_.default, (x, [(3,)], src, True)),
                     (aten._index_put_impl_.default, (x, [(3,)], src, True))):
        assert _cost_shapes(op, args) == Flops(other=18)  # one add per source element
        if op.overloadpacket in (aten.index_put, aten.index_put_, aten._index_put_impl_):
            assert _cost_shapes(op, args[:3] + (False,)) == ZERO  # a scatter copy: no arithmetic
    # inductor's embedding backward: values added into their rows where the mask holds, one add each
    assert _cost_shapes(aten._unsafe_masked_index_put_accumulate.default, (x, (3,), [(3,)], src)) == Flops(other=18)
    for op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
        # 3 bags × 5 indices: 15 rows of 8 added (120), then one pass over the (3, 8) output
        HIT.add(_key(op))
        got = lookup(op).formula((100, 8), (15,), (3,), out_shape=((3, 8), (15,)), ctx=CostContext(op=op))
        assert got == Flops(other=120 + 24)
    for op in (aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default):
        assert _cost_shapes(op, ((3, 8), (15,))) == Flops(other=15 * 8)  # one add per index and value


def test_foreach_ops_cost_their_single_tensor_twin():
    shapes = [(3, 4), (5,)]
    for op in (aten._foreach_add.List, aten._foreach_mul_.Scalar, aten._foreach_sqrt.default):
        assert _cost_shapes(op, (shapes, shapes)) == Flops(other=12 + 5)  # 1 per element, like add
    for op in (aten._foreach_copy_.default, aten._foreach_zero_.default):
        assert _cost_shapes(op, (shapes, shapes)) == ZERO  # copies and fills: no arithmetic



def test_fused_optimizer_kernels_cost_their_foreach_steps():
    # op for op as torch/optim's _multi_tensor_adam/_sgd/_adagrad, 1 per element each (17 elements):
    # Adam/AdamW lerp, mul, addcmul, sqrt, div, add, addcdiv (7), +1 each for weight decay, amsgrad, maximize
    shapes = [(3, 4), (5,)]
    lists = (shapes,) * 6
    for op in (aten._fused_adam_.default, aten._fused_adamw_.default):
        plain, every = dict(weight_decay=0.0, amsgrad=False, maximize=False), dict(weight_decay=0.1, amsgrad=True, maximize=True)
        assert _cost_shapes(op, lists, kwargs=plain) == Flops(other=7 * 17)
        assert _cost_shapes(op, lists, kwargs=every) == Flops(other=10 * 17)
    # SGD: the update (1); momentum's mul and add after the first step (on it, a clone), Nesterov's add
    sgd = aten._fused_sgd_.default
    assert _cost_shapes(sgd, lists[:3], kwargs=dict(weight_decay=0.0, momentum=0.0)) == Flops(other=17)
    first = dict(weight_decay=0.01, momentum=0.9, nesterov=True, is_first_step=True)
    assert _cost_shapes(sgd, lists[:3], kwargs=first) == Flops(other=3 * 17)
    later = dict(weight_decay=0.0, momentum=0.9, nesterov=False, is_first_step=False)
    assert _cost_shapes(sgd, lists[:3], kwargs=later) == Flops(other=3 * 17)
    # Adagrad: addcmul, sqrt, add, mul, addcdiv (5), +1 weight decay
    assert _cost_shapes(aten._fused_adagrad_.default, lists[:4], kwargs=dict(weight_decay=0.1)) == Flops(other=6 * 17)


@pytest.mark.parametrize("optimizer, args", [
    ("adam", {}), ("adamw", {}), ("adam", {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}), ("adagrad", {"weight_decay": 0.1}),
])
def test_a_fused_step_counts_what_the_foreach_step_counts(optimizer, args):
    """The oracle: the foreach step of the same optimizer, traced op by op (its _foreach_* ops)."""
    def step_flops(impl: str):
        cfg = fxacct.Config(target=target("examples/mlp.py:MLP"), batch=2, optimizer=optimizer,
                            kwargs=dict(d_model=32, d_hidden=64, n_blocks=2), optim_args={**args, impl: True})
        acct = fxacct.profile(cfg).accounting
        return acct.totals.optimizer_flops, acct.unsupported_ops

    assert step_flops("fused") == step_flops("foreach")


def test_fft_counts_by_fftws_convention():
    # benchFFT (fftw.org/speed/method.html): 5·N·log2(N) per complex transform of N points, half
    # for real data; a normalization scales each output element (2 FLOPs for a complex one)
    x = torch.randn(4, 8, 16)
    assert fx_cost(aten._fft_r2c.default, (x, [2], 0, True)) == Flops(other=160 * 32)  # 2.5·16·4, 32 rows
    X = torch.fft.rfft(x)
    assert fx_cost(aten._fft_c2r.default, (X, [2], 2, 16)) == Flops(other=160 * 32 + 4 * 8 * 16)  # irfft: 1/N
    c = torch.randn(2, 8, 16, dtype=torch.cfloat)
    assert fx_cost(aten._fft_c2c.default, (c, [1, 2], 0, True)) == Flops(other=5 * 128 * 7 * 2)  # 2-D: N = 128
    assert fx_cost(aten._fft_c2c.default, (c, [2], 1, True)) == Flops(other=5 * 16 * 4 * 16 + 2 * 256)  # ortho
    odd = torch.randn(3, 12, dtype=torch.cfloat)
    assert fx_cost(aten._fft_c2c.default, (odd, [1], 0, True)) == Flops(other=round(5 * 12 * math.log2(12)) * 3)

def _cell_backward_flops(gates, cell, biases, b, i, h) -> int:
    """Elementwise FLOPs of autograd through torch's cell, every input needing a gradient."""
    x, hx, cx, w_ih, w_hh = r(b, i), r(b, h), r(b, h), r(gates * h, i), r(gates * h, h)
    bias = (r(gates * h), r(gates * h)) if biases else ()

    def forward(x, hx, cx, w_ih, w_hh, *bias):
        return cell(x, (hx, cx) if gates == 4 else hx, w_ih, w_hh, *bias)

    def joint(x, hx, cx, w_ih, w_hh, *rest):
        bias, grads = rest[:-2], rest[-2:]
        ins = [t.detach().requires_grad_(k != 2 or gates == 4)  # GRU/RNN cells have no c
               for k, t in enumerate((x, hx, cx, w_ih, w_hh) + tuple(bias))]
        out = forward(*ins)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, [t for t in ins if t.requires_grad], grads[:len(out)])

    tensors = (x, hx, cx, w_ih, w_hh) + bias
    return decomposed_flops(joint, *tensors, r(b, h), r(b, h)) - decomposed_flops(forward, *tensors)


@pytest.mark.parametrize("gates,cell", [(4, torch.lstm_cell), (3, torch.gru_cell), (1, torch.rnn_tanh_cell)])
@pytest.mark.parametrize("biases", [True, False])
def test_rnn_layer_backward(gates, cell, biases):
    t, b, i, h = 3, 2, 5, 4
    g = gates
    shapes = ((t, b, i), (g * h, i), (g * h, h), (g * h,), (g * h,), (1, b, h), (1, b, h)) + (None,) * 6
    tail = (False, 2, h, 1, biases, True, False, [], False)
    # other, per step: the cell's backward, plus the add joining the output's gradient with the
    # recurrent gradient from the next step (B·H; a layer's, not a cell's)
    other = t * (_cell_backward_flops(gates, cell, biases, b, i, h) + b * h)
    per_ih, per_hh = 2 * t * b * g * h * i, 2 * t * b * g * h * h
    back_in_time = 2 * (t - 1) * b * g * h * h  # dh_{t-1} = dgates_t · W_hh, t = 1..T-1
    cases = {  # grad_mask (input, w_ih, w_hh, b_ih, b_hh, hx, cx) -> dX + dW_ih + dW_hh + dh
        None: 2 * per_ih + 2 * per_hh,
        (True, True, True, True, True, False, True): 2 * per_ih + per_hh + back_in_time,
        (False, True, False, True, True, True, False): per_ih + per_hh,
        (True, False, True, False, False, False, False): per_ih + per_hh + back_in_time,
    }
    for mask, matmul in cases.items():
        got = _cost_shapes(aten.mkldnn_rnn_layer_backward.default, shapes + tail, grad_mask=mask)
        assert got == Flops(matmul=matmul, other=other)


def test_miopen_batch_norm_equals_torch_decomposition_of_cudnn():
    # no decomposition of its own and no CPU kernel: the same computation as cudnn_batch_norm
    args = (XC, C3, B3, RM.clone(), RV.clone(), True, 0.1, 1e-5)
    expected = decomposed_flops(lambda *a: aten.cudnn_batch_norm(*a), *args)
    assert fx_cost(aten.miopen_batch_norm.default, args, out=()) == Flops(other=expected)


def test_tag_fallback_and_transcendentals():
    # no own formula: torch's pointwise tag gives 1 FLOP per output element — for exp and tanh too
    # (a convention: transcendentals are not weighted, as flop_counter and fvcore do not count them)
    x, out = (4, 6), (4, 6)
    for op in (aten.sigmoid.default, aten.exp.default, aten.tanh.default):
        assert lookup(op).formula(x, out_shape=out, ctx=CostContext(op=op)) == Flops(other=24)
    # a reduction tag: 1 per input element
    for op in (aten.amax.default, aten.sum.dim_IntList, aten.var_mean.correction):
        assert lookup(op) is registry._REGISTRY[torch.Tag.reduction]
        HIT.add(_key(op))
        assert lookup(op).formula(x, [1], out_shape=(4,), ctx=CostContext(op=op)) == Flops(other=24)
    assert lookup(aten.transpose_.default).formula(x, 0, 1, out_shape=x, ctx=CostContext()) == ZERO
    HIT.update({torch.Tag.pointwise, torch.Tag.reduction, torch.Tag.inplace_view})


def test_python_logical_operators_cost_as_bitwise_ops():
    # `mask_a | mask_b` dispatches to aten.__or__.Tensor, which torch does not tag pointwise
    # (FSDP2/DTensor code does it); it costs as bitwise_or: 1 per output element, 4·6 = 24
    x = (4, 6)
    for op in (aten.__or__.Tensor, aten.__and__.Tensor, aten.__ior__.Tensor, aten.__iand__.Tensor,
               aten.__ixor__.Tensor):
        assert lookup(op).formula(x, x, out_shape=x, ctx=CostContext(op=op)) == Flops(other=24), op
        HIT.add(op)
    for op in (aten.__or__.Scalar, aten.__and__.Scalar, aten.__ior__.Scalar, aten.__iand__.Scalar,
               aten.__ixor__.Scalar):
        assert lookup(op).formula(x, True, out_shape=x, ctx=CostContext(op=op)) == Flops(other=24), op
        HIT.add(op)


def test_untagged_floor_divide_histc_and_scatter():
    # torch tags none of these pointwise/reduction; MoE routing (Mixtral's grouped_mm path) uses them.
    # floor_divide: one division per output, 4·6 = 24; histc: one bin lookup per input, 24;
    # scatter with reduce="add": one add per index/src element, 2·6 = 12; plain scatter: a copy
    x = (4, 6)
    for op in (aten.floor_divide.default, aten.floor_divide_.Tensor):
        assert fx_cost(op, (r(*x), r(*x)), out=torch.empty(x)) == Flops(other=24), op
    assert fx_cost(aten.floor_divide.Scalar, (r(*x), 2), out=torch.empty(x)) == Flops(other=24)
    HIT.add(aten.floor_divide_.Scalar)
    assert fx_cost(aten.histc.default, (r(*x), 10), out=torch.empty(10)) == Flops(other=24)
    index = torch.zeros(2, 6, dtype=torch.long)
    for op, extra in ((aten.scatter.reduce, (r(2, 6),)), (aten.scatter.value_reduce, (1.0,))):
        got = fx_cost(op, (r(*x), 0, index, *extra), {"reduce": "add"}, out=torch.empty(x))
        assert got == Flops(other=12), op
    HIT.update({aten.scatter_.reduce, aten.scatter_.value_reduce})
    for op in (aten.scatter.src, aten.scatter_.value):
        info = lookup(op)
        assert info.movement and info.formula(x, 0, (2, 6), (2, 6), out_shape=x, ctx=CostContext()) == ZERO
        HIT.add(_key(op))


def test_untagged_activations_cost_as_their_tagged_siblings():
    # hardsigmoid, elu, hardtanh, leaky_relu, softplus and mish carry torch's pointwise tag (1 FLOP
    # per output element, the transcendental convention above); these siblings do not, and cost
    # the same: 4·6 = 24. masked_fill_ as masked_fill (tagged)
    x = (4, 6)
    for op in (aten.hardswish.default, aten.hardswish_.default, aten.mish_.default, aten._prelu_kernel.default,
               aten.log_sigmoid_forward.default, aten.hardswish_backward.default, aten.hardsigmoid_backward.default,
               aten.mish_backward.default, aten.elu_backward.default, aten.hardtanh_backward.default,
               aten.leaky_relu_backward.default, aten.log_sigmoid_backward.default, aten.softplus_backward.default,
               aten.softshrink_backward.default, aten.hardshrink_backward.default, aten.masked_fill_.Scalar):
        assert lookup(op).formula(x, x, out_shape=x, ctx=CostContext(op=op)) == Flops(other=24), op
        HIT.add(_key(op))
    assert torch.Tag.pointwise in aten.masked_fill.Scalar.tags and torch.Tag.pointwise in aten.hardsigmoid.default.tags
    # PReLU's backward: where(x > 0, g, w·g) and x·g where x ≤ 0, two passes each: 4·24 = 96
    got = fx_cost(aten._prelu_kernel_backward.default, (r(*x), r(*x), r(6)))
    assert got == Flops(other=96)


def test_interpolation_padding_backward_and_distances():
    # bilinear: 4 taps, a multiply and an add each, per output element: (1, 2, 6, 8) → 2·4·96 = 768;
    # its backward per incoming gradient element, the same 768; bicubic 16 taps: 2·16·96 = 3072;
    # linear 2 taps on (1, 2, 10): 2·2·20 = 80; trilinear 8 on (1, 1, 2, 4, 4): 2·8·32 = 512
    x4 = r(1, 2, 3, 4)
    assert fx_cost(aten.upsample_bilinear2d.default, (x4, [6, 8], False)) == Flops(other=768)
    assert fx_cost(aten.upsample_bilinear2d.vec, (x4, [6, 8], False, None)) == Flops(other=768)
    assert fx_cost(aten.upsample_bilinear2d_backward.default, (r(1, 2, 6, 8), [6, 8], [1, 2, 3, 4], False)) \
        == Flops(other=768)
    assert fx_cost(aten.upsample_bicubic2d.default, (x4, [6, 8], False)) == Flops(other=3072)
    assert fx_cost(aten.upsample_bicubic2d_backward.default, (r(1, 2, 6, 8), [6, 8], [1, 2, 3, 4], False)) \
        == Flops(other=3072)
    assert fx_cost(aten.upsample_linear1d.default, (r(1, 2, 5), [10], False)) == Flops(other=80)
    assert fx_cost(aten.upsample_linear1d_backward.default, (r(1, 2, 10), [10], [1, 2, 5], False)) == Flops(other=80)
    assert fx_cost(aten.upsample_trilinear3d.default, (r(1, 1, 1, 2, 2), [2, 4, 4], False)) == Flops(other=512)
    assert fx_cost(aten.upsample_trilinear3d_backward.default,
                   (r(1, 1, 2, 4, 4), [2, 4, 4], [1, 1, 1, 2, 2], False)) == Flops(other=512)
    # a padding's backward: (1, 1, 4, 4) padded by 1 on each side is (1, 1, 6, 6); each of the 36
    # gradient elements lands in one of the 16 inputs, the first arrival a write: 36 − 16 = 20 adds
    x, g = r(1, 1, 4, 4), r(1, 1, 6, 6)
    for op in (aten.reflection_pad2d_backward.default, aten.replication_pad2d_backward.default):
        assert fx_cost(op, (g, x, [1, 1, 1, 1])) == Flops(other=20), op
    for op in (aten.reflection_pad1d_backward.default, aten.replication_pad1d_backward.default):
        assert fx_cost(op, (r(1, 1, 6), r(1, 1, 4), [1, 1])) == Flops(other=2), op  # 6 − 4
    for op in (aten.reflection_pad3d_backward.default, aten.replication_pad3d_backward.default):
        assert fx_cost(op, (r(1, 1, 4, 4, 4), r(1, 1, 2, 2, 2), [1] * 6)) == Flops(other=56), op  # 64 − 8
    # cdist of (2, 5, 3) and (2, 4, 3): 2·5·4 = 40 pairs of 3-vectors, 3 passes each: 360, and
    # its backward the same per pair
    a, b = r(2, 5, 3), r(2, 4, 3)
    d = torch.cdist(a, b)
    assert fx_cost(aten._cdist_forward.default, (a, b, 2.0, None)) == Flops(other=360)
    assert fx_cost(aten._cdist_backward.default, (r(2, 5, 4), a, b, 2.0, d)) == Flops(other=360)


def test_smooth_l1_and_huber_losses():
    # n = 24: d = x − y, |d|, |d| < β, the branch's value (2): 5·24 = 120, + 24 for the mean or sum;
    # backward x − y, the compare, d/β or sign(d), · grad: 4·24 = 96
    for fwd, bwd in ((aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default),
                     (aten.huber_loss.default, aten.huber_loss_backward.default)):
        for red, expected in ((0, 120), (1, 144), (2, 144)):
            assert fx_cost(fwd, (X2, r(4, 6), red, 1.0)) == Flops(other=expected), (fwd, red)
        grad = r(4, 6)
        assert fx_cost(bwd, (grad, X2, r(4, 6), 0, 1.0)) == Flops(other=96), bwd


def test_unknown_op_is_reported_not_zero():
    import torch.fx as fx

    from fxacct.account.annotate import node_cost
    from fxacct.trace.graph_builder import INPUT, OP, NodeTrace

    op = aten.linalg_eigh.default
    assert lookup(op) is None
    g = fx.Graph()
    a = g.placeholder("a")
    a.meta.update(val=torch.empty(4, 4, device="meta"), trace=NodeTrace(INPUT, "forward", ""))
    n = g.call_function(op, (a,))
    n.meta.update(val=(torch.empty(4, device="meta"), torch.empty(4, 4, device="meta")),
                  trace=NodeTrace(OP, "forward", ""))
    assert node_cost(n).unsupported  # counted and listed in every report


def test_duplicate_registration_is_rejected():
    before = registry._REGISTRY[aten.mm]
    with pytest.raises(ValueError, match="already has a cost formula"):
        registry.register(aten.mm)(lambda *a, **k: ZERO)
    assert registry._REGISTRY[aten.mm] is before


def test_zero_cost_ops():
    # data movement and creation: bytes, no arithmetic (DESIGN.md "copy" / "creation" kinds)
    for key, info in registry._REGISTRY.items():
        if info.movement or info.creation or key is torch.Tag.inplace_view:
            assert info.formula((2, 3), out_shape=(2, 3), ctx=CostContext()) == ZERO, key
            HIT.add(key)
    assert lookup(aten.clone.default).movement and lookup(aten.zeros.default).creation


def test_metadata_checks_cost_nothing():
    # torch.export's _assert_tensor_metadata (in every stage of an automatic pipeline split) reads a
    # tensor's dtype and device, no data: 0 FLOPs; it returns nothing, so it allocates nothing and
    # moves no bytes (the view kind: 0 new bytes, no roofline time)
    from fxacct.account.annotate import op_kind
    from fxacct.trace import aliasing

    op = aten._assert_tensor_metadata.default
    assert lookup(op).formula((2, 3), out_shape=None, ctx=CostContext()) == ZERO
    assert op_kind(op, True) == aliasing.VIEW
    assert op_kind(aten.mm.default, True) == aliasing.COMPUTE  # a returning op is not
    HIT.add(aten._assert_tensor_metadata)


def test_collectives_cost_no_flops():
    # fxacct.parallel registers every collective the engines issue (and FSDP2's copy-in/out ops)
    # at zero FLOPs: a reduction's adds are not model FLOPs; their bytes and wire bytes are
    # accounted apart (fxacct.parallel.collectives)
    from fxacct.parallel import collectives

    collectives.register_fsdp_copies()  # as a mesh's first prepare does
    ops = list(collectives._OPS) + [torch.ops.fsdp.all_gather_copy_in.default,
                                    torch.ops.fsdp.split_with_sizes_copy.default, torch.ops.fsdp.chunk_cat.default]
    # the reduce-scatter copy-in torch 2.15 runs instead of chunk_cat (same schema, same copy)
    ops += [torch.ops.fsdp.chunk_cat_mixed_dtype.default] if hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype") else []
    for op in ops:
        info = lookup(op)
        assert info is not None, op
        assert info.formula((4, 8), out_shape=(16, 8), ctx=CostContext()) == ZERO, op
        HIT.add(op)


def test_every_registered_formula_is_exercised(request):
    # runs last (file order): every key of the registry was reached by a case above; meaningless
    # when only some of this file's tests were selected (-k, a node id), so it skips then
    here = [i for i in request.session.items if i.module is request.module]
    names = {i.originalname for i in here}
    tests = {n for n in dir(request.module) if n.startswith("test_")}
    if names != tests or here[-1] is not request.node:
        pytest.skip("needs every test of tests/test_formulas.py, in file order")
    # fxacct's own formulas (a user's, registered by another test through --costs, are not ours)
    missing = [str(k) for k, info in registry._REGISTRY.items()
               if k not in HIT and info.formula.__module__.startswith("fxacct.")]
    assert not missing, missing
