"""Predict: the device table (datasheet figures), CPU/GPU calibration, CUDA target rules and the roofline time model."""
