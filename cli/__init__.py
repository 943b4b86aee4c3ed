"""The fxacct command line (installed as the import package `fxacct_cli`)."""
