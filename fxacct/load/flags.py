"""What a request's flags can be told without torch: their defaults and choices, and the checks that
answer before torch, transformers or networkx are imported (a malformed -k, a missing model file or
Hugging Face config, an unknown --dtype, --amp or --gpu; --mesh is fxacct.load.mesh's, -o
fxacct.load.output_path's). Config runs the same checks (one function each), so the library and the
CLI say the same line; the CLI runs them first, so a usage error costs no torch import."""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fxacct.devices import get_device
from fxacct.dtypes import check_dtype_name
from fxacct.errors import UsageError

HF_PREFIX = "hf:"
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# torch.compile's modes (torch/__init__.py, compile's ``mode``); fxacct.trace.compiled says what each changes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CAUSAL_CONVENTIONS = ("full", "halved")
SUM, CROSS_ENTROPY, MSE, MODEL = "sum", "cross-entropy", "mse", "model"
LOSSES = (SUM, CROSS_ENTROPY, MSE, MODEL)
DEFAULT_DEPTH = 2  # module nesting shown by the text and markdown tables (--depth)
DEFAULT_TOP = 10  # nodes listed by the text table (--top)


@dataclass(frozen=True)
class Defaults:
    """Config's defaults that the CLI's --help shows (Config takes its own from here)."""

    batch: int = 1
    optimizer: str = "adamw"
    world_size: int = 1
    shard: str = "none"
    loss: str = SUM
    causal_attention: str = "full"
    reshard_after_forward: bool = True
    gpus_per_node: int = 8
    pp_schedule: str = "1f1b"


DEFAULTS = Defaults()


def split_assignment(text: str, flag: str, example: str) -> tuple[str, str, object]:
    """'NAME=VALUE' -> (name, value text, the value as a Python literal, or the text itself when
    it is none); a UsageError naming ``flag`` and an ``example`` when there is no NAME=."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise UsageError(f"malformed {flag} {text!r}: expected NAME=VALUE such as {example}")
    try:
        return key.strip(), value.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip(), value.strip()


def parse_kwarg(text: str) -> tuple[str, object]:
    """'d=512' -> ('d', 512); values are Python literals when they parse, else strings."""
    key, _, value = split_assignment(text, "-k", "-k d_model=512")
    return key, value


def model_file(target: str, flag: str | None = None) -> tuple[Path, str]:
    """'examples/gpt2.py:GPT' -> (the file, 'GPT'); a malformed spec or a missing file is a UsageError
    (``flag``: the flag that named the file, where it is not the model's, e.g. --optimizer)."""
    path_text, sep, name = target.rpartition(":")
    what = f"{flag} file" if flag else "model file"
    if not sep or not path_text or not name:
        if flag:
            raise UsageError(f"malformed {flag} {target!r}: expected PATH.py:Name, the file and the class it defines")
        raise UsageError(f"malformed model {target!r}: expected PATH.py:Name such as examples/gpt2.py:GPT, "
                         "package.module:Name such as torch.nn:Linear, or hf:DIR_OR_CONFIG_JSON")
    path = Path(path_text)
    if path.is_dir():
        raise UsageError(f"{what} {path_text!r} is a directory; give the .py file in it that defines {name} "
                         f"(PATH.py:{name}), or hf:{path_text} for a Hugging Face config there")
    if not path.is_file():
        raise UsageError(f"{what} {path_text!r} not found; give a path to a .py file, relative to {os.getcwd()}")
    if path.suffix != ".py":
        raise UsageError(f"{what} {path_text!r} is not a Python file (.py); give PATH.py:Name such as "
                         "examples/gpt2.py:GPT")
    return path, name


def hf_config_file(path_text: str) -> Path:
    """The config.json of ``hf:DIR_OR_CONFIG_JSON`` (a directory means its config.json)."""
    path = Path(path_text)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"no Hugging Face config at {path_text!r}: give a local directory holding "
                         "config.json or the path of a config.json (fxacct never downloads)")
    return file


def is_module_path(target: str) -> bool:
    """'torch.nn:Linear' (package.module:Name), not 'model.py:Net'."""
    path, sep, name = target.rpartition(":")
    return bool(sep) and bool(_MODULE_PATH.match(path)) and not path.endswith(".py") and name.isidentifier()


TORCHTITAN_PREFIX = "torchtitan:"  # fxacct.load.torchtitan.PREFIX


def check_target(target: str | None) -> None:
    """The checks of a model spec that need no import: a ``PATH.py:Name`` file or an ``hf:`` config
    that is not there (``package.module:Name`` is checked when it is imported, and
    ``torchtitan:MODULE:CONFIG`` by fxacct.load.torchtitan, which needs torchtitan)."""
    if target is None or target.startswith(TORCHTITAN_PREFIX):
        return
    if target.startswith(HF_PREFIX):
        hf_config_file(target[len(HF_PREFIX):])
    elif not is_module_path(target):
        model_file(target)


def check_request(target: str | None, dtype=None, amp=None, gpu: str | None = None) -> None:
    """A request's strings that can be refused before torch is imported, in Config's order
    (--dtype, --amp, --gpu), then the model spec, which Config leaves to loading."""
    for value in (dtype, amp):
        if isinstance(value, str):
            check_dtype_name(value)
    if gpu is not None:
        get_device(gpu)
    check_target(target)


__all__ = ["HF_PREFIX", "CAUSAL_CONVENTIONS", "COMPILE_MODES", "SUM", "CROSS_ENTROPY", "MSE", "MODEL", "LOSSES", "DEFAULT_DEPTH",
           "DEFAULT_TOP", "Defaults", "DEFAULTS", "split_assignment", "parse_kwarg", "model_file", "hf_config_file",
           "is_module_path", "check_target", "check_request"]
