"""Tensors and devices: the model runner, sampling, attention backends, models."""
