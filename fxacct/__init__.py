"""fxacct: what one training step of a PyTorch model costs — FLOPs, bytes, time — node by node,
computed on fake tensors before you rent a GPU.

    >>> import fxacct
    >>> p = fxacct.profile(fxacct.Config(target="examples/two_layer.py:TwoLayer", batch=2))
    >>> p.accounting.totals.forward.matmul
    60
"""

from fxacct.api import profile, profile_module
from fxacct.errors import FxacctError, ModelError, UsageError
from fxacct.load.config import Config
from fxacct.step import Profile
from fxacct.units import FLOPS_PER_FMA, GB, GiB

__version__ = "0.1.0"
__all__ = ["Config", "Profile", "profile", "profile_module", "FxacctError", "UsageError", "ModelError",
           "FLOPS_PER_FMA", "GB", "GiB", "__version__"]
