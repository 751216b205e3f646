"""Weight quantization: int8/int4 weight-only, W8A8 with SmoothQuant, fp8, and bf16 prepacking.
"""
