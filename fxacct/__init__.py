"""fxacct: what one training step of a PyTorch model costs — FLOPs, bytes, time — node by node,
computed on fake tensors before you rent a GPU.

    >>> import fxacct
    >>> p = fxacct.profile(fxacct.Config(target="examples/two_layer.py:TwoLayer", batch=2))
    >>> p.accounting.totals.forward.matmul
    60

The names that need torch (Config, Profile, profile, profile_module) load on first use, so the
errors and units (and a CLI's --help) do not wait for torch to import.
"""

import importlib

from fxacct.errors import FxacctError, ModelError, UsageError
from fxacct.units import FLOPS_PER_FMA, GB, GiB

__version__ = "0.1.0"

_LAZY = {"Config": "fxacct.load.config", "Profile": "fxacct.step", "profile": "fxacct.api",
         "profile_module": "fxacct.api"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxacct' has no attribute {name!r}")


__all__ = ["Config", "Profile", "profile", "profile_module", "FxacctError", "UsageError", "ModelError",
           "FLOPS_PER_FMA", "GB", "GiB", "__version__"]
