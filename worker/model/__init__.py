"""The model: Llama decoder, attention backends, fused ops, CUDA graphs, loading and the random test models.
"""
