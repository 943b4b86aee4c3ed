"""Memory: lifetimes and peaks of a step (peak), ZeRO/FSDP partitioning per rank (sharding),
and the per-dtype account of parameters, gradients, optimizer state and activations (account)."""
