"""`python -m fxacct` is the `fxacct` command."""

from fxacct_cli.main import main

main()
