"""Errors a user can act on. Each carries the exit code DESIGN.md assigns and a one-line message
that names the problem and the fix; the CLI prints the message alone (the traceback with --debug)."""


class FxacctError(Exception):
    exit_code = 1


class UsageError(FxacctError):
    """Bad flag or value, malformed spec, missing file or name (exit 2)."""

    exit_code = 2


class ModelError(FxacctError):
    """The model failed: constructor or forward raised, or it cannot be traced on fake tensors (exit 3)."""

    exit_code = 3


USER_FRAMES_HINT = "rerun with --debug for the traceback"


def describe_exception(e: BaseException) -> str:
    """'ValueError: bad width (at model.py:12)': the exception's first line and where in the
    user's code it was raised (the innermost frame outside torch and fxacct)."""
    import traceback

    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and "/fxacct/" not in f.filename and "/fxacct_cli/" not in f.filename]
    if frames:
        f = frames[-1]
        where = f"{f.filename}:{f.lineno}"
        text += f" (at {where}" + (f": {f.line.strip()}" if not lines and f.line else "") + ")"
    return text


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
