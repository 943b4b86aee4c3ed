"""Load: a model spec (PATH.py:Name, package.module:Name, hf:DIR_OR_CONFIG_JSON), constructor kwargs, input specs and the frozen Config; flag values parsed exactly."""
