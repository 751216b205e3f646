"""Sampling: the batched sampler, per-request logit adjustments and grammar-constrained decoding.
"""
