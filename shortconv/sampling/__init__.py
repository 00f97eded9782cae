"""Sampling: parameters, the batched sampler and grammar-constrained decoding."""
