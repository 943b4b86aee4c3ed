"""Errors a user can act on, and whose code an exception came from.

Each error carries the exit code DESIGN.md assigns and a one-line message that names the problem
and the fix; the CLI prints the message alone (the traceback with --debug).

While fxacct drives the user's model (constructor, capture, real runs) an exception may come from
the user's code (a model error, exit 3) or from fxacct's own (a bug: exit 4). ``classify`` decides
by the traceback, innermost frame first:

- a frame in the user's files (anything outside the fxacct package, torch and the standard
  library: third-party model code such as transformers counts as the user's) raised it: a model
  error naming that file:line and its source statement;
- a frame of fxacct raised it: an internal error;
- torch (or the standard library) raised it: walk outward to the nearest other frame and decide
  by that one, except that fxacct frames marked ``@passes_through`` (a dispatch or function
  mode's ``func(*args)``) are walked past when the frame they called is torch's.
- The walk ends in the user's code when it meets a frame marked ``@calls_user_code`` (fxacct's
  call of the user's constructor, factory or example_inputs), or when it reaches fxacct's own
  frame from inside a module's forward (torch's ``Module.__call__``, a ``forward`` in torch.nn)
  or autograd's backward of the model's graph: then the model itself is torch code (an
  ``nn.Sequential``, an ``nn.Linear`` given the wrong shape) and the error is still the model's.
- ``@acts_for_torch`` marks fxacct code that does torch's own job where torch calls it (the
  saved-tensor hook that makes autograd's in-place check): its frames count as torch's.
- An exception raised in an fxacct frame that torch called back (a hook, a replacement of a torch
  function), or whose innermost frame outside torch is fxacct's (no module's forward in between),
  is fxacct's even though torch made the call from inside the model's forward: the walk never gets
  past that frame to the model's. One such call leaves no frame of fxacct's at all: torch
  calling a function fxacct handed it (``called_by_torch``) with arguments that do not fit its
  signature, a TypeError raised at torch's call site (a release that changed the call, as torch
  2.15 added a keyword to FSDP2's copy-out); its message names the function, and it is fxacct's.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from types import CodeType

USER_FRAMES_HINT = "rerun with --debug for the traceback"
INTERNAL_HINT = "rerun with --debug and report it"


class FxacctError(Exception):
    exit_code = 4  # fxacct cannot go on (e.g. this torch lacks an API it needs); subclasses say why


class UsageError(FxacctError):
    """Bad flag or value, malformed spec, missing file or name, unwritable output (exit 2)."""

    exit_code = 2


class ModelError(FxacctError):
    """The model failed: constructor or forward raised, or it cannot be traced on fake tensors (exit 3)."""

    exit_code = 3


class CompileError(ModelError):
    """A region of the model does not compile under --compile (exit 3): torch.compile's own error,
    not the inputs'."""


class InternalError(FxacctError):
    """fxacct's own code raised: a bug to report (exit 4)."""

    exit_code = 4


# -- frames that only forward a call ------------------------------------------------------------

_PASS_THROUGH: set[CodeType] = set()


def passes_through(fn):
    """Mark ``fn`` as forwarding a call on the user's behalf (a dispatch mode calling the op, a
    wrapper calling the model): an exception that reached it from torch is judged by the frames
    outside it. Its own statements still count as fxacct's: keep such functions thin."""
    _PASS_THROUGH.add(fn.__code__)
    return fn


_CALLS_USER: set[CodeType] = set()


def calls_user_code(fn):
    """Mark ``fn`` as the call into the user's code (constructor, factory, example_inputs): what
    reaches it from torch was raised running the user's object, even one torch defines (a model
    file's ``Model = nn.Linear``), so it is the user's."""
    _CALLS_USER.add(fn.__code__)
    return fn


_AS_TORCH: set[CodeType] = set()


def acts_for_torch(fn):
    """Mark ``fn`` as doing torch's own job where torch calls it (a saved-tensor hook that makes
    autograd's version check): what it raises is judged as if torch had raised it."""
    _AS_TORCH.add(fn.__code__)
    return fn


_CALLED_BY_TORCH: set[str] = set()  # qualified names


def called_by_torch(fn):
    """Mark ``fn`` as handed to torch for torch to call (a hook, a torch function's replacement):
    torch calling it with arguments its signature refuses is fxacct's bug, never the model's.
    Returns ``fn``; call it where fxacct registers the function, or use it as a decorator."""
    _CALLED_BY_TORCH.add(fn.__qualname__)
    return fn


# CPython's messages for a call whose arguments do not bind (Python/ceval.c, "%U() takes %d
# positional argument%s but %d %s given", "... missing %d required ... argument", "... got an
# unexpected keyword argument", "... got multiple values for argument"); since Python 3.10 %U is the
# function's qualified name
_REFUSED_CALL = re.compile(r"(\S+)\(\) (?:takes |missing \d+ required |got an unexpected keyword argument |"
                           r"got multiple values for argument |got some positional-only arguments )")


def _refused_call_of_fxacct(e: BaseException | None) -> bool:
    """Whether ``e`` is torch's call of a ``called_by_torch`` function failing to bind."""
    if not isinstance(e, TypeError):
        return False
    match = _REFUSED_CALL.match(str(e))
    return match is not None and match.group(1) in _CALLED_BY_TORCH


# -- where a frame's code lives -------------------------------------------------------------------

USER, FXACCT, TORCH, STDLIB = "user", "fxacct", "torch", "stdlib"


def _dir_of(module_name: str) -> str | None:
    module = sys.modules.get(module_name)  # looked up, never imported: fxacct must not import its CLI
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths})


_STDLIB = _stdlib_dirs()


def frame_kind(filename: str) -> str:
    if filename.startswith("<frozen "):
        return STDLIB
    path = os.path.abspath(filename)
    for kind, name in ((FXACCT, "fxacct"), (FXACCT, "fxacct_cli"), (TORCH, "torch")):
        directory = _dir_of(name)
        if directory is not None and path.startswith(directory):
            return kind
    if path.startswith(_STDLIB) and "site-packages" not in path and "dist-packages" not in path:
        return STDLIB
    return USER


def _model_entries() -> set[CodeType]:
    """torch's code that runs the model: a module call, autograd's backward of its graph."""
    torch = sys.modules.get("torch")
    if torch is None:
        return set()
    module = torch.nn.Module
    fns = [module.__call__, getattr(module, "_wrapped_call_impl", None), getattr(module, "_call_impl", None),
           torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward]
    return {f.__code__ for f in fns if getattr(f, "__code__", None) is not None}


def _is_module_forward(frame) -> bool:
    return frame.name == "forward" and f"{os.sep}torch{os.sep}nn{os.sep}" in os.path.abspath(frame.filename)


# -- the decision ----------------------------------------------------------------------------------

_FORWARDED = re.compile(r"\bfunc\(")  # the forwarded call's line in a passes_through function


def _blame(frames: list, e: BaseException | None = None) -> tuple[str, object]:
    """(USER or FXACCT, the frame to name or None) for an exception ``e`` with these frames,
    outermost first."""
    if not frames or _refused_call_of_fxacct(e):
        return FXACCT, frames[-1] if frames else None  # the call site that passed what fxacct refused
    kinds = [TORCH if f.code in _AS_TORCH else frame_kind(f.filename) for f in frames]
    if kinds[-1] == FXACCT and frames[-1].code in _PASS_THROUGH and _FORWARDED.search(frames[-1].line):
        kinds[-1] = TORCH  # the call it forwarded raised in torch's C++ (a conv given a long tensor)
    if kinds[-1] in (USER, FXACCT):
        return kinds[-1], frames[-1]
    entries = _model_entries()
    in_model, named = False, None  # inside the model's own (torch) code; its innermost forward frame
    for i in range(len(frames) - 1, -1, -1):
        f, kind = frames[i], kinds[i]
        if kind == USER:
            return USER, f
        if kind == TORCH:
            if named is None and _is_module_forward(f):
                in_model, named = True, f
            in_model = in_model or f.code in entries
            continue
        if kind == STDLIB:
            continue
        if f.code in _CALLS_USER:
            return USER, named or frames[i + 1]
        # an fxacct frame (never the innermost here) is walked past if it only forwarded the call
        if not (f.code in _PASS_THROUGH and (kinds[i + 1] == TORCH or frames[i + 1].code in _PASS_THROUGH)):
            return (USER, named) if in_model else (FXACCT, f)
    return (USER, named) if in_model else (FXACCT, None)


class _Frame:
    """What the decision needs of one traceback entry."""

    def __init__(self, tb):
        code = tb.tb_frame.f_code
        self.code, self.name, self.filename, self.lineno = code, code.co_name, code.co_filename, tb.tb_lineno
        summary = traceback.FrameSummary(self.filename, self.lineno, self.name)
        self.line = summary.line or ""
        self.end_lineno = self.lineno
        positions = list(code.co_positions()) if hasattr(code, "co_positions") else []
        if tb.tb_lasti >= 0 and tb.tb_lasti // 2 < len(positions):
            start, end = positions[tb.tb_lasti // 2][:2]
            if start == self.lineno and end is not None and end > start:
                self.end_lineno = end


def _frames(e: BaseException) -> list[_Frame]:
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append(_Frame(tb))
        tb = tb.tb_next
    return frames


def _shown_path(filename: str) -> str:
    """Relative to the working directory when under it; torch's files from its parent directory."""
    path = os.path.abspath(filename)
    torch_dir = _dir_of("torch")
    bases = [os.getcwd() + os.sep] + ([os.path.dirname(torch_dir.rstrip(os.sep)) + os.sep] if torch_dir else [])
    for base in bases:
        if path.startswith(base):
            return path[len(base):]
    return filename


def _statement(frame: _Frame) -> str:
    """The source text of the frame's failing statement, on one line."""
    import linecache

    lines = [linecache.getline(frame.filename, n) for n in range(frame.lineno, frame.end_lineno + 1)]
    text = " ".join(_code_part(line) for line in lines if _code_part(line)) or frame.line.strip()
    return text if len(text) <= 160 else text[:157] + "..."


def _code_part(line: str) -> str:
    """A source line without its comment and surrounding blanks."""
    import io
    import tokenize

    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[:token.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):  # a line of a longer statement: its comment came first
        pass
    return line.strip()


def where(frame: _Frame) -> str:
    """'examples/gpt2.py:23: assert n_embd % n_head == 0'"""
    statement = _statement(frame)
    return f"{_shown_path(frame.filename)}:{frame.lineno}" + (f": {statement}" if statement else "")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _what(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def describe_exception(e: BaseException) -> str:
    """'ValueError: bad width (at model.py:12: raise ValueError(...))': the exception's first line
    and the frame it is blamed on (see ``classify``)."""
    _, frame = _blame(_frames(e), e)
    return _what(e) + (f" (at {where(frame)})" if frame is not None else "")


def internal_error(e: BaseException, doing: str | None = None) -> InternalError:
    """The one-line InternalError for an exception fxacct's own code raised."""
    _, frame = _blame(_frames(e), e)
    at = f" (at {where(frame)})" if frame is not None else ""
    during = f" during {doing}" if doing else ""
    return InternalError(f"internal error {_what(e)}{at}{during}; {INTERNAL_HINT}")


def classify(e: BaseException, doing: str) -> FxacctError:
    """A ModelError or an InternalError (see the module docstring) for an exception raised while
    fxacct ran ``doing``: "the model's forward", "GPT(n_embd=30)". Raise it ``from e``."""
    if isinstance(e, FxacctError):
        return e
    kind, frame = _blame(_frames(e), e)
    if kind == FXACCT:
        return internal_error(e, doing)
    at = f" (at {where(frame)})" if frame is not None else ""
    return ModelError(f"{doing} raised {_what(e)}{at}; {USER_FRAMES_HINT}")


__all__ = ["FxacctError", "UsageError", "ModelError", "CompileError", "InternalError", "passes_through", "calls_user_code", "acts_for_torch",
           "called_by_torch", "classify",
           "describe_exception", "internal_error", "first_line", "frame_kind", "USER_FRAMES_HINT"]
