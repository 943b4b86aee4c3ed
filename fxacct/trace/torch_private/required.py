"""The one lookup of a private torch name: a release that moved it fails here, naming it."""

import torch

from fxacct.errors import FxacctError


def _require(owner, name: str, where: str):
    fn = getattr(owner, name, None)
    if fn is None:
        raise FxacctError(
            f"this torch ({torch.__version__}) has no {where}.{name}, which fxacct needs; "
            "install a torch release fxacct supports (torch>=2.13,<=2.14.1, docs/compat.md)"
        )
    return fn
