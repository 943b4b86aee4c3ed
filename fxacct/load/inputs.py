"""Input specs: `--input 'long[B,1024]<50257'`, `--input 'input_ids=long[B,1024]'`.

DTYPE[DIM,...] with DTYPE a short or torch name, each DIM an integer or B (the batch);
`NAME=` makes it a keyword input; `<HIGH` is the exclusive upper bound of an integer input's
values in a real run (token ids below the vocabulary size).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from fxacct.dtypes import dtype_name, parse_dtype
from fxacct.errors import UsageError

_SPEC = re.compile(r"^\s*(?:(?P<name>[A-Za-z_]\w*)\s*=\s*)?(?P<dtype>[\w.]+)\s*\[(?P<dims>[^\]]*)\]\s*"
                   r"(?:<\s*(?P<high>-?\d+))?\s*$")  # a negative bound is matched, to be refused by name

# on an integer input: every value lies below this (its --input's <N; an example's largest id + 1),
# which fxacct.trace.dispatch_recorder checks against the embedding table it indexes, as eager does
BOUND = "_fxacct_bound"

_HELP = "expected DTYPE[DIM,...] such as 'long[B,1024]', 'float32[B,3]' or 'input_ids=long[B,128]<50257' (B is --batch)"


@dataclass(frozen=True)
class InputSpec:
    name: str | None
    dtype: torch.dtype
    dims: tuple[int | str, ...]  # "B" stands for the batch
    high: int | None = None

    def shape(self, batch: int) -> tuple[int, ...]:
        return tuple(batch if d == "B" else d for d in self.dims)

    def make(self, batch: int, device="meta") -> torch.Tensor:
        """A tensor for this spec: empty on meta; random values (below `high`) on a real device."""
        shape = self.shape(batch)
        if math.prod(shape) * self.dtype.itemsize >= 1 << 63:  # torch sizes storages in int64 bytes
            raise UsageError(f"--input {self}: a tensor of shape {list(shape)} is more than torch can address "
                             "(2^63 bytes); give smaller dimensions")
        if torch.device(device).type == "meta":
            t = torch.empty(shape, dtype=self.dtype, device="meta")
            if self.high is not None:
                setattr(t, BOUND, self.high)  # values are no meta tensor's: the bound stands for them
            return t
        if self.dtype.is_floating_point:
            return torch.randn(shape, device=device).to(self.dtype)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, shape, device=device).bool()
        return torch.randint(0, self.high or 2, shape, dtype=self.dtype, device=device)

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.dims)
        text = f"{dtype_name(self.dtype)}[{dims}]"
        if self.name:
            text = f"{self.name}={text}"
        return text + (f"<{self.high}" if self.high is not None else "")


def parse_input_spec(text: str) -> InputSpec:
    m = _SPEC.match(text)
    if m is None:
        raise UsageError(f"malformed --input {text!r}: {_HELP}")
    try:
        dtype = parse_dtype(m["dtype"])
    except UsageError as e:
        raise UsageError(f"malformed --input {text!r}: {e}") from None
    dims: list[int | str] = []
    for d in (x.strip() for x in m["dims"].split(",")) if m["dims"].strip() else ():
        if d == "B":
            dims.append("B")
        elif d.isdigit() and int(d) > 0:
            dims.append(int(d))
        else:
            raise UsageError(f"malformed --input {text!r}: dimension {d!r} is not a positive integer or B; {_HELP}")
    high = int(m["high"]) if m["high"] else None
    if high is not None and dtype.is_floating_point:
        raise UsageError(f"malformed --input {text!r}: '<{high}' bounds integer inputs only; drop it or use an integer dtype")
    if high is not None and high <= 0:
        raise UsageError(f"malformed --input {text!r}: the bound '<{high}' must be a positive integer (values are drawn from 0 to N-1)")
    return InputSpec(m["name"], dtype, tuple(dims), high)


def describe(t) -> str:
    """'float32[2,3]' for a tensor or a TensorMeta (the JSON config's input list)."""
    return f"{dtype_name(t.dtype)}[{','.join(str(s) for s in t.shape)}]"
