"""A plain-PyTorch Llama (RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention)
with a torchtitan-style ``parallelize(model, mesh)`` and a pipeline split.

Sources: Touvron et al., "Llama 2", 2023; torchtitan (github.com/pytorch/torchtitan,
models/llama3/model.py and infra/parallelize.py), whose layer names and plan this follows:
q/k/v and w1/w3 column-wise, wo and w2 row-wise, the embedding row-wise and the output
projection column-wise; with sequence parallel the norms run on sequence shards.

    fxacct profile examples/llama.py:Llama --mesh fsdp=2,tp=2 --parallelize examples/llama.py:parallelize

The layers are a ModuleDict keyed "0".."n-1" (as in torchtitan) so that a pipeline stage can
drop the layers it does not own and keep the names of those it does (``pipeline_stage``).
Heads are read from the local weight shapes in forward, so the same code runs unsharded and
under tensor parallelism (each rank then holds n_heads / tp query heads and n_kv_heads / tp
key/value heads).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """``in_float32``: normalized in float32 and cast back before the weight, as torchtitan's
    RMSNorm does (torchtitan/models/norms.py, 2024-12: ``self._norm(x.float()).type_as(x) *
    self.weight``); else in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, in_float32: bool = False):
        super().__init__()
        self.eps, self.in_float32 = eps, in_float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_float32:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq: int, theta: float = 10000.0) -> torch.Tensor:
    """cos and sin of the rotary angles, stacked: (2, max_seq, head_dim)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); the rotate-half form of RoPE, computed in the tables' float32 and
    cast back to x's dtype, as torchtitan's ``apply_rotary_emb`` does (``.type_as(xq)``): under
    bfloat16 parameters (FSDP2's MixedPrecisionPolicy) attention then runs in bfloat16."""
    t = x.shape[-2]
    cos, sin = rope[0, :t], rope[1, :t]
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        groups = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `groups` heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float, norm_float32: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps, norm_float32)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim, eps, norm_float32)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(tokens: (B, T) long) -> logits (B, T, vocab)``. The defaults are a small model."""

    def __init__(self, vocab_size: int = 512, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int = 2, hidden: int = 128, max_seq: int = 64, eps: float = 1e-5,
                 float_logits: bool = False, norm_float32: bool = False):
        super().__init__()
        # float_logits: the logits cast to float32, as torchtitan's Transformer.forward does
        # (torchtitan/models/llama/model.py, 2024-12: ``self.output(h).float()``) before its loss;
        # norm_float32: the RMSNorms computed in float32, as torchtitan's (RMSNorm's docstring)
        self.float_logits = float_logits
        self.n_heads, self.n_kv_heads, self.max_seq, self.vocab_size = n_heads, n_kv_heads, max_seq, vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden, eps, norm_float32) for i in range(n_layers)})
        self.norm = RMSNorm(dim, eps, norm_float32)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.register_buffer("rope", rope_tables(dim // n_heads, max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        return logits.float() if self.float_logits else logits

    def example_inputs(self, batch: int):
        return (torch.randint(0, self.vocab_size, (batch, self.max_seq)),)


def tp_plan(sequence_parallel: bool = False) -> tuple[dict, dict]:
    """(root plan, per-block plan) in torchtitan's form."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    sp = sequence_parallel
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    block = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
        block["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
        block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return root, block


def _tensor_parallel(model: Llama, mesh, sequence_parallel: bool) -> None:
    """tp_plan on the mesh's ``tp`` dimension, when it has one of size > 1."""
    from torch.distributed.tensor.parallel import parallelize_module

    if "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
        return
    tp = mesh["tp"].size()
    if model.n_heads % tp or model.n_kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide n_heads={model.n_heads} and n_kv_heads={model.n_kv_heads}")
    root, block = tp_plan(sequence_parallel)
    parallelize_module(model, mesh["tp"], {k: v for k, v in root.items() if getattr(model, k) is not None})
    for layer in model.layers.values():
        parallelize_module(layer, mesh["tp"], block)


def parallelize(model: Llama, mesh, sequence_parallel: bool = False, reshard_after_forward: bool = True):
    """Tensor parallel on the mesh's ``tp`` dimension (if any), then FSDP2 on ``fsdp`` (and ``dp``
    as replicate-shard, HSDP) per block and at the root, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names or ()
    _tensor_parallel(model, mesh, sequence_parallel)
    dims = tuple(d for d in ("dp", "fsdp") if d in names)
    if dims:
        fsdp_mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
        for layer in model.layers.values():
            fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=False)
    return model


def parallelize_torchtitan(model: Llama, mesh):
    """FSDP2 as torchtitan's ``apply_fsdp`` applies it (torchtitan/parallelisms/parallelize_llama.py,
    2024-12, the version of its published H100 runs): ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` (its training.mixed_precision_param / _reduce defaults), each block
    resharded after forward but the last (FSDP would prefetch it again at once), the root
    resharded; tensor parallel first on a ``tp`` dimension, as ``parallelize``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = mesh.mesh_dim_names or ()
    _tensor_parallel(model, mesh, sequence_parallel=True)
    dims = tuple(d for d in ("dp", "fsdp") if d in names)
    if dims:
        fsdp_mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers.values()):
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=i < last)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=True)
    return model


def torchtitan_sac():
    """torchtitan's per-op selective activation checkpointing policy (``selective_ac_option = "op"``,
    torchtitan/parallelisms/parallelize_llama.py, 2024-12): save the outputs of attention, of
    reduce-scatters, of ``max`` and of every other matmul of a block call (odd-numbered ones,
    counted apart in the forward and the recompute); recompute the rest. A factory: fxacct calls it
    once per checkpointed block call, as torchtitan's ``selective_checkpointing_context_fn`` does.

        fxacct profile examples/llama.py:Llama --checkpoint 'layers.*' \\
            --checkpoint-policy examples/llama.py:torchtitan_sac
    """
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default, aten.max.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def split_points(model: Llama, stages: int) -> list[str]:
    """The FQNs that begin stages 1..stages-1: the layers divided as evenly as they go."""
    n = len(model.layers)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} layers")
    return [f"layers.{(n * s) // stages}" for s in range(1, stages)]


def pipeline_stage(model: Llama, stage: int, stages: int) -> Llama:
    """Keep stage ``stage``'s layers (and the embedding on the first, norm and output on the last)."""
    n = len(model.layers)
    lo, hi = (n * stage) // stages, (n * (stage + 1)) // stages
    for key in [k for k in model.layers if not lo <= int(k) < hi]:
        del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


def parallelize_sp(model: Llama, mesh):
    """``parallelize`` with sequence parallelism (norms and residuals on sequence shards)."""
    return parallelize(model, mesh, sequence_parallel=True)
