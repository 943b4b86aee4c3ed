"""View, copy, compute, in-place or creation: read from the op's schema, not from a hand list.

- `inplace`: an argument is annotated as written (`Tensor(a!)`), so the op mutates existing
  storage (add_, copy_, out= variants): 0 new bytes.
- `view`: a return carries a read-only alias annotation (`Tensor(a)`), so it shares its input's
  storage (view, transpose, expand, slice, split, detach...): 0 new bytes, 0 FLOPs. An op that
  returns nothing and writes nothing (torch.export's ``_assert_tensor_metadata`` checks) is one too.
- plus VIEW_EXCEPTIONS, ops whose schema says "fresh tensor" but whose output takes over its
  input's storage; tests/test_aliasing.py checks every kind against FakeTensor storage identity.
- otherwise the op allocates: `creation` (from sizes alone), `copy` (0 FLOPs in the registry:
  cat, clone, _to_copy...), `compute`.
"""

from functools import cache

import torch

aten = torch.ops.aten

# aten._unsafe_view: "view without the view checks", returned by reshape after a copy and by
# matmul's folding; it re-uses its input's storage (see native_functions.yaml). unsafe_split /
# unsafe_chunk: split without the view bookkeeping (used by the GRU/LSTM cells); same storage.
VIEW_EXCEPTIONS = frozenset({
    aten._unsafe_view.default, aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default,
    aten.unsafe_chunk.default,
})

VIEW, COPY, COMPUTE, INPLACE, CREATION, INPUT = "view", "copy", "compute", "inplace", "creation", "input"
KINDS = (INPUT, VIEW, COPY, COMPUTE, INPLACE, CREATION)


@cache
def schema_kind(op) -> str | None:
    """`inplace` or `view` from the alias annotations, else None (the op allocates)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return INPLACE
    if op in VIEW_EXCEPTIONS or any(r.alias_info is not None for r in schema.returns):
        return VIEW
    if not schema.returns:  # returns nothing (torch.export's _assert_tensor_metadata): no data, no bytes
        return VIEW
    return None
