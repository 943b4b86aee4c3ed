"""A model file whose import raises (a dependency that is not installed)."""
import fxacct_no_such_package_xyz  # noqa: F401
