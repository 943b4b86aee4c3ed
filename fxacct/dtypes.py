"""Dtype names: flags accept short names (fp32, bf16, ...) and torch names; output uses torch names."""

import torch

from fxacct.errors import UsageError

_SHORT = {
    "fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "half": torch.float16, "float": torch.float32, "double": torch.float64,
    "long": torch.int64, "int": torch.int32, "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' -> torch.bfloat16; a UsageError naming the choices otherwise."""
    key = name.strip().lower().removeprefix("torch.")
    if key in _SHORT:
        return _SHORT[key]
    dtype = getattr(torch, key, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise UsageError(
        f"unknown dtype {name!r}: use a short name (fp32, bf16, fp16, fp8, long, bool) "
        "or a torch name (float32, bfloat16, float8_e5m2, int64, ...)"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the torch name without its prefix)."""
    return str(dtype).removeprefix("torch.")
