"""Tensor-parallel-ready layers: each parameter carries a ``weight_loader`` that copies
this rank's slice of a checkpoint tensor into it."""
