"""Many GPUs: a device mesh (``--mesh fsdp=8,tp=8``), the model parallelized by PyTorch's own
engine (the user's ``parallelize(model, mesh)``, or the plan a model carries plus FSDP2) under a
fake process group, one representative rank traced below the DTensor layer, and every collective
the engine issues as a node of kind ``collective``."""
