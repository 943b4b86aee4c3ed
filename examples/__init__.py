"""Example PyTorch models used to exercise fxacct's FLOP and memory accounting."""
