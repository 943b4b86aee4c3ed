"""The fxacct command line (installed as the import package `fxacct_cli`)."""

import warnings

# torch warns at import when NumPy is absent ("Failed to initialize NumPy"); fxacct never hands
# tensors to NumPy, so on a machine without it the warning would only be noise above every report
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
