"""Predict: the device table (datasheet figures), CPU/GPU calibration, CUDA target rules, the roofline time model and, for a --gpu, kernels at achievable rates (gpu_kernels)."""
