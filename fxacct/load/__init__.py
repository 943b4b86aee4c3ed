"""Load: a model spec (PATH.py:Name), constructor kwargs, input specs and the frozen Config; flag values parsed exactly."""
