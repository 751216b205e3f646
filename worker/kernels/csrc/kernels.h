// Every kernel the extension exports (bindings.cpp binds each by name) and that decode_stack.cpp calls across units.
#pragma once
#include "aten.h"
#include <tuple>
#include <vector>

// attention (unit_attention.cpp)
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor lens, int64_t bs, double scale);
void paged_kv_write(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slot_mapping);
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                            torch::Tensor q_lens, torch::Tensor ctx_lens, int64_t bs, double scale);
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                                torch::Tensor v_scale, torch::Tensor tables, torch::Tensor lens, int64_t bs,
                                double scale);
void paged_kv_write_int8(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                         torch::Tensor v_scale, torch::Tensor slot_mapping, int64_t bs, double grow);
torch::Tensor paged_prefill_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                                 torch::Tensor v_scale, torch::Tensor tables, torch::Tensor q_lens,
                                 torch::Tensor ctx_lens, int64_t bs, double scale);

// sampling, fused ops, quantized linears and the decode stack (unit_ops.cpp)
torch::Tensor race_sample(torch::Tensor probs, torch::Tensor seed, torch::Tensor step, torch::Tensor seed_hi);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rope_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_t, torch::Tensor sin_t, int64_t n_rot);
std::tuple<torch::Tensor, torch::Tensor> w8a8_quantize(torch::Tensor x, torch::Tensor smooth, int64_t pad_rows = 0);
torch::Tensor w8a8_dequantize(torch::Tensor y, torch::Tensor row_scale, torch::Tensor col_scale, torch::Tensor like);
std::tuple<torch::Tensor, torch::Tensor> w8a8_silu_mul_quantize(torch::Tensor y, torch::Tensor row_scale,
                                                                torch::Tensor col_scale, torch::Tensor smooth,
                                                                torch::Tensor like, int64_t pad_rows);
bool w8a8_small_available();
std::tuple<torch::Tensor, torch::Tensor> w8a8_small_pack(torch::Tensor wt);
torch::Tensor w8a8_small_linear(torch::Tensor x, torch::Tensor inv_smooth, torch::Tensor packed, torch::Tensor colsum,
                                torch::Tensor col_scale);
torch::Tensor w8a16_small_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor colsum, torch::Tensor col_scale);
bool w8a8_avx2_available();
torch::Tensor w8a8_avx2_pack(torch::Tensor wt);
torch::Tensor w8a8_avx2_linear(torch::Tensor x, torch::Tensor inv_smooth, torch::Tensor packed,
                               torch::Tensor col_scale);
int64_t w8a8_avx2_wide_rows(int64_t rows);
torch::Tensor w8a16_avx2_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale);
int64_t w8a16_avx2_bound(int64_t K);
torch::Tensor decode_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> kinds,
                           torch::Tensor positions, torch::Tensor cos_t, torch::Tensor sin_t,
                           torch::Tensor slot_mapping, torch::Tensor tables, torch::Tensor lens, int64_t nh,
                           int64_t kvh, int64_t bs, double scale, double eps, bool int8_kv, double grow);
