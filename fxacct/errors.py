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
