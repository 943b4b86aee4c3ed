"""Cost formulas a user registers for their own ops (a torch.library custom op, a Triton kernel's
wrapper op): ``--costs PATH.py`` imports a file whose top level calls ``fxacct.costs.register``.

    import torch
    from fxacct.costs import Flops, register

    @register(torch.ops.mylib.fused_gelu_linear)
    def fused_gelu_linear(x, w, *args, out_shape, ctx, **kwargs):
        m, k = x; n = w[0]
        return Flops(matmul=2 * m * k * n, other=8 * m * n)

A file is imported once per process (a second --costs of the same file is a no-op); a file that
fails to import, or registers an op that already has a formula, is a usage error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fxacct.costs.registry import registering_from
from fxacct.errors import UsageError

_LOADED: set[Path] = set()


def load_costs(path: str) -> None:
    """Import PATH.py for its registrations (fxacct.costs.register)."""
    file = Path(path).expanduser().resolve()
    if file in _LOADED:
        return
    if not file.is_file() or file.suffix != ".py":
        raise UsageError(f"--costs {path}: no such Python file; give a .py file that calls "
                         "fxacct.costs.register")
    spec = importlib.util.spec_from_file_location(f"fxacct_user_costs_{len(_LOADED)}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        with registering_from(path):
            spec.loader.exec_module(module)
    except Exception as e:  # the user's file: one line naming it and what it raised
        raise UsageError(f"--costs {path} failed to load: {type(e).__name__}: {e}") from None
    _LOADED.add(file)
