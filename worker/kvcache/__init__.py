"""KV memory: page accounting, the cache tensors, the radix prefix cache and its block-event log.
"""
