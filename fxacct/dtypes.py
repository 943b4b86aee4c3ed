"""Dtype names: flags accept short names (fp32, bf16, ...) and torch names; output uses torch names.

Names are checked without torch (``check_dtype_name``: a usage error answers before torch is
imported); ``parse_dtype`` imports torch to hand back the dtype itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxacct.errors import UsageError

if TYPE_CHECKING:
    import torch

_SHORT = {
    "fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "half": "float16", "float": "float32", "double": "float64",
    "long": "int64", "int": "int32", "bool": "bool",
}
# every torch.dtype that torch 2.13 and 2.14 name as a module attribute (``isinstance(getattr(torch,
# n), torch.dtype)``), aliases included; tests/test_startup.py holds it equal to the installed torch's
TORCH_NAMES = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
    "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2",
    "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half",
    "int", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int7", "int64", "int8", "long",
    "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32",
    "uint4", "uint5", "uint6", "uint7", "uint64", "uint8",
})


def check_dtype_name(name: str) -> str:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' -> 'bfloat16' (torch's attribute name); a UsageError
    naming the choices otherwise."""
    key = name.strip().lower().removeprefix("torch.")
    key = _SHORT.get(key, key)
    if key in TORCH_NAMES:
        return key
    raise UsageError(
        f"unknown dtype {name!r}: use a short name (fp32, bf16, fp16, fp8, long, bool) "
        "or a torch name (float32, bfloat16, float8_e5m2, int64, ...)"
    )


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' -> torch.bfloat16; a UsageError naming the choices otherwise."""
    import torch  # here, not at the top: a name is checked before torch is imported

    dtype = getattr(torch, check_dtype_name(name), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise UsageError(f"unknown dtype {name!r}: torch {torch.__version__} has no dtype of that name")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the torch name without its prefix)."""
    return str(dtype).removeprefix("torch.")
