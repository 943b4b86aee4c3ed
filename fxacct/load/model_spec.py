"""Load: resolve "PATH.py:Name" (fxacct.load.source has the other spec forms) to a module built on the meta device and its example inputs.

`Name` is an nn.Module subclass or a factory returning one; constructor arguments come from the
config's kwargs. Inputs, first match wins: the config's input specs; an `example_inputs(batch)`
method on the module (static, class or instance method); an `example_inputs(batch)` function in
the file. Every failure is a one-line UsageError (exit 2), ModelError (exit 3: the user's code
raised) or InternalError (exit 4: fxacct's own code raised; fxacct.errors.classify decides).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from fxacct.errors import FxacctError, ModelError, UsageError, calls_user_code, classify
from fxacct.load.flags import model_file, parse_kwarg, split_assignment  # noqa: F401  (re-exported)

_HOW_INPUTS = ("no inputs: pass --input 'long[B,1024]' (repeatable; B is --batch), or define "
               "example_inputs(self, batch) on the model class or example_inputs(batch) in the file")


def _import_file(path: Path, what: str = "the model file") -> ModuleType:
    name = f"fxacct_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    added = [p for p in (str(path.parent.resolve()), os.getcwd()) if p not in sys.path]
    sys.path[:0] = added
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise ModelError(f"{path}:{e.lineno}: syntax error ({e.msg}); fix {what}") from e
    except Exception as e:
        del sys.modules[name]
        raise classify(e, f"importing {path}") from e
    finally:
        for p in added:
            sys.path.remove(p)
    return module


KIND_NAMES = {torch.nn.Module: "nn.Module", torch.optim.Optimizer: "torch.optim.Optimizer"}


def resolve(target: str, base: type = torch.nn.Module, flag: str | None = None):
    """'examples/gpt2.py:GPT' -> (the object named GPT, the imported file module). ``base``: the kind
    of class the name should be (the model's nn.Module, an --optimizer's torch.optim.Optimizer),
    those defined there listed when the name is not; ``flag``: the flag that named the file, if not the model."""
    path, name = model_file(target, flag)
    path_text = target.rpartition(":")[0]
    module = _import_file(path, f"the {flag} file" if flag else "the model file")
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, base) and v.__module__ == module.__name__)
        kind = KIND_NAMES.get(base, base.__name__)
        hint = f"{kind} classes defined there: {', '.join(found)}" if found else f"no {kind} class is defined there"
        raise UsageError(f"{(flag + ' ') if flag else ''}{path_text} has no name {name!r}; {hint}")
    return obj, module


def build(obj, kwargs: dict, name: str, device="meta") -> torch.nn.Module:
    """Call the class or factory on ``device`` (meta: parameters get shapes, never memory)."""
    if not callable(obj):
        raise UsageError(f"{name} is {_a(type(obj).__name__)}, not an nn.Module class or a factory returning one")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            missing = [p.name for p in sig.parameters.values()
                       if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                       and p.name not in kwargs]
            if missing:
                example = " ".join(f"-k {m}=..." for m in missing)
                raise UsageError(f"{name}() needs argument(s) {', '.join(missing)}: pass them with {example} "
                                 f"or --kwargs JSON") from None
            raise UsageError(f"{name}() does not take these arguments ({e}); check -k/--kwargs") from None
    try:
        with torch.device(device):
            model = call_user(obj, **kwargs)
    except (FxacctError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        if device == "meta" and _reads_values(e):  # torchvision's RegNet: widths from tensor math, .tolist()
            return build(obj, kwargs, name, device="cpu")  # its weights are allocated, once
        raise classify(e, f"{name}({_kwargs_text(kwargs)})") from e
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{name} returned {_a(type(model).__name__)}, not an nn.Module; "
                         "name an nn.Module class or a factory that returns one")
    return model


def _reads_values(e: Exception) -> bool:
    """A constructor that reads tensor values, which the meta device does not have."""
    text = str(e)
    return "Cannot copy out of meta tensor" in text or "cannot be called on meta tensors" in text


def resolve_function(target: str, flag: str, form: str):
    """The function ``flag`` names as PATH.py:fn, which fxacct will call as ``form``
    ("fn(model, mesh)"): a missing file, name or a signature that cannot take those arguments is
    a usage error naming the flag (the model's own loading says "model")."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name or not path_text.endswith(".py"):
        raise UsageError(f"{flag} {target}: give PATH.py:fn, a function called as {form}")
    if not Path(path_text).is_file():
        raise UsageError(f"{flag} {target}: file {path_text!r} not found (relative to {os.getcwd()})")
    module = _import_file(Path(path_text), f"the {flag} file")
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__)
        what = "no name" if fn is None else f"{_a(type(fn).__name__)}, not a function, as"
        hint = f"functions defined there: {', '.join(found)}" if found else "it defines no function"
        raise UsageError(f"{flag} {target}: {path_text} has {what} {name!r}; {hint}")
    return fn


def check_call(fn, flag: str, target: str, form: str, *args) -> None:
    """A usage error when ``fn`` cannot be called with ``args`` (the form fxacct calls it in)."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as e:
        raise UsageError(f"{flag} {target}: {fn.__name__} cannot be called as {form} ({e})") from e
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass


@calls_user_code
def call_user(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` for the user's class, factory or example_inputs: what it raises is
    the user's even when fn is torch's own (an nn.Linear named in the model file)."""
    return fn(*args, **kwargs)


def example_inputs_fn(model: torch.nn.Module, file_module: ModuleType | None):
    """The model's example_inputs method, else its file's example_inputs function, else None."""
    fn = getattr(model, "example_inputs", None)
    if not callable(fn) and file_module is not None:
        fn = getattr(file_module, "example_inputs", None)
    return fn if callable(fn) else None


def example_inputs(model: torch.nn.Module, file_module: ModuleType | None, batch: int, device="meta"):
    """(args, kwargs) from the model's or the file's example_inputs(batch), or None."""
    fn = example_inputs_fn(model, file_module)
    if fn is None:
        return None
    try:
        with torch.device(device):
            value = call_user(fn, batch)
    except FxacctError:
        raise
    except Exception as e:
        raise classify(e, f"example_inputs({batch})") from e
    return split_inputs(value)


def split_inputs(value):
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    raise UsageError(f"example_inputs returned {_a(type(value).__name__)}; return a tensor, a tuple of "
                     "positional inputs or a dict of keyword inputs")


def require_inputs(found):
    if found is None:
        raise UsageError(_HOW_INPUTS)
    return found


def _kwargs_text(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Inputs that forward cannot take are a usage error (exit 2), not a model failure."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        params = ", ".join(sig.parameters)
        given = f"{len(args)} positional" + (f" and keyword {', '.join(repr(k) for k in kwargs)}" if kwargs else "")
        raise UsageError(f"the inputs do not fit forward({params}): got {given} ({e}); give one --input per "
                         "parameter, NAME=SPEC for keyword parameters") from None
