"""Native kernels: the C++ CPU extension and its loader, CPU feature detection, and the Triton GPU kernels.
"""
