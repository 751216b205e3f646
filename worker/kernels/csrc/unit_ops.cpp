// Compilation unit: the sampler, fused layer ops, quantized linears and the decode stack that calls them.
#include "kernels.h"
#include "race_sample.cpp"
#include "fused_ops.cpp"
#include "w8a8.cpp"
#include "w8a8_small.cpp"
#include "w8a8_avx2.cpp"
#include "decode_stack.cpp"
