"""`python -m fxacct` is the `fxacct` command: it runs the CLI package's own __main__ (the
library never imports its CLI)."""

import runpy

runpy.run_module("fxacct_cli", run_name="__main__", alter_sys=True)
