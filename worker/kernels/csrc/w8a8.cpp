// The two passes around an int8 x int8 -> int32 matrix product (`torch._int_mm`, VNNI on CPUs that have it) for
// activation-and-weight int8 linears (worker/quant.py, W8A8): quantize the activation rows with a per-channel
// smoothing factor (SmoothQuant) and a per-row scale, then turn the int32 products back into the model dtype.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace w8a8 {

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) { return load_bf16x16(p); }
#endif

// one row: the largest |x * smooth|, then codes rounded half to even (AVX-512 by hand: GCC gathers and
// scalarizes these loops)
template <typename T>
static float quantize_row(const T* x, const float* smooth, int8_t* q, int64_t K) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16)
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_mul_ps(load16(x + k), _mm512_loadu_ps(smooth + k))));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f(x[k]) * smooth[k]));
  const float scale = std::max(amax, 1e-6f) / 127.f, inv = 1.f / scale;
  k = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load16(x + k), _mm512_loadu_ps(smooth + k)), vinv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#endif
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::nearbyint(to_f(x[k]) * smooth[k] * inv));
  return scale;
}

template <typename T>
static void quantize(const T* x, const float* smooth, int8_t* q, float* row_scale, int64_t M, int64_t K) {
  // rows per task: ~16k elements, so decode-sized calls run inline instead of waking the thread team
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) row_scale[m] = quantize_row(x + m * K, smooth, q + m * K, K);
  });
}

// Acc: int32 products (torch._int_mm) or the same integers as fp32 (oneDNN's int8 product at unit scales):
// static_cast<float> of either gives the same value, so both give the same bits
template <typename T, typename Acc>
static void dequantize(const Acc* y, const float* row_scale, const float* col_scale, T* out, int64_t M,
                       int64_t N) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / N), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const Acc* ym = y + m * N;
      T* om = out + m * N;
      const float rs = row_scale[m];
      #pragma omp simd
      for (int64_t n = 0; n < N; ++n) om[n] = from_f<T>(static_cast<float>(ym[n]) * rs * col_scale[n]);
    }
  });
}

// gate_up's sums y [>= M, 2n] -> the int8 codes of silu(gate) * up for the next linear: per row, the dequantize,
// silu_mul (fused_ops.cpp) and quantize passes in order, each rounding to T where it does, in buffers that stay
// in cache (the same bits as the three passes, without writing and reading back two [M, n..2n] tensors)
template <typename T, typename Acc>
static void silu_mul_quantize(const Acc* y, const float* row_scale, const float* col_scale, const float* smooth,
                              int8_t* q, float* q_scale, int64_t M, int64_t n) {
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / n), [&](int64_t begin, int64_t end) {
    std::vector<T> gu(2 * n), h(n);
    for (int64_t m = begin; m < end; ++m) {
      const Acc* ym = y + m * 2 * n;
      const float rs = row_scale[m];
      #pragma omp simd
      for (int64_t j = 0; j < 2 * n; ++j) gu[j] = from_f<T>(static_cast<float>(ym[j]) * rs * col_scale[j]);
      silu_mul_row<T>(gu.data(), gu.data() + n, h.data(), n);
      q_scale[m] = quantize_row(h.data(), smooth, q + m * n, n);
    }
  });
}

// W8A16 (int8 weight-only linears on int16 activation rows, csrc/w8a8_avx2.cpp and w8a8_small.cpp): the largest
// |code| of a row of K features such that every int32 sum of K products with int8 weights (|w| <= 127) stays
// exact; 14 bits where K <= 1,057, 12 at K = 4,096
static int64_t a16_bound(int64_t K) { return std::min<int64_t>(16383, 2147483647LL / (127 * K)); }

// x [M, K] -> int16 codes per row (|code| <= bound), row scale amax / bound; both W8A16 kernels quantize here, so
// their outputs are the same bits
template <typename T>
static void quantize_a16(const T* x, int16_t* q, float* rs, int64_t M, int64_t K, int64_t bound) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_f(row[k])));
    const float scale = std::max(amax, 1e-30f) / static_cast<float>(bound), inv = 1.f / scale;
    int16_t* qm = q + m * K;
    for (int64_t k = 0; k < K; ++k) qm[k] = static_cast<int16_t>(std::nearbyint(to_f(row[k]) * inv));
    rs[m] = scale;
  }
}

}  // namespace w8a8

// int8 [max(M, pad_rows), K] for M rows of codes: the rows past M zeroed (oneDNN's padded row count)
static torch::Tensor padded_codes(int64_t M, int64_t pad_rows, int64_t K, const torch::TensorOptions& like) {
  const int64_t rows = std::max(M, pad_rows);
  auto q = torch::empty({rows, K}, like.dtype(torch::kInt8));
  if (rows > M) std::memset(q.data_ptr<int8_t>() + M * K, 0, (rows - M) * K);
  return q;
}

// x [M, K] bf16/fp32, smooth [K] fp32 (1 / SmoothQuant factor) -> (int8 [max(M, pad_rows), K] (rows past M are
// zeros), per-row scales [M] fp32)
std::tuple<torch::Tensor, torch::Tensor> w8a8_quantize(torch::Tensor x, torch::Tensor smooth, int64_t pad_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && smooth.scalar_type() == torch::kFloat32 &&
              smooth.is_contiguous() && smooth.numel() == x.size(1), "w8a8_quantize: x [M, K], fp32 smooth [K]");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = padded_codes(M, pad_rows, K, x.options());
  auto rs = torch::empty({M}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kBFloat16) {
    w8a8::quantize<at::BFloat16>(x.data_ptr<at::BFloat16>(), smooth.data_ptr<float>(), q.data_ptr<int8_t>(),
                                 rs.data_ptr<float>(), M, K);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "w8a8_quantize: bfloat16 or float32");
    w8a8::quantize<float>(x.data_ptr<float>(), smooth.data_ptr<float>(), q.data_ptr<int8_t>(), rs.data_ptr<float>(),
                          M, K);
  }
  return {q, rs};
}

template <typename Acc>
static void dequantize_as(const torch::Tensor& y, const torch::Tensor& row_scale, const torch::Tensor& col_scale,
                          torch::Tensor& out) {
  const int64_t M = y.size(0), N = y.size(1);
  if (out.scalar_type() == torch::kBFloat16) {
    w8a8::dequantize<at::BFloat16, Acc>(y.data_ptr<Acc>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(),
                                        out.data_ptr<at::BFloat16>(), M, N);
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32, "w8a8_dequantize: bfloat16 or float32");
    w8a8::dequantize<float, Acc>(y.data_ptr<Acc>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(),
                                 out.data_ptr<float>(), M, N);
  }
}

// y [M, N] int32 products (or the same integers as fp32), row_scale [M], col_scale [N] fp32 -> [M, N] of `like`'s
// dtype
torch::Tensor w8a8_dequantize(torch::Tensor y, torch::Tensor row_scale, torch::Tensor col_scale, torch::Tensor like) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() &&
              (y.scalar_type() == torch::kInt32 || y.scalar_type() == torch::kFloat32),
              "w8a8_dequantize: int32 or fp32 [M, N]");
  TORCH_CHECK(row_scale.numel() == y.size(0) && col_scale.numel() == y.size(1) &&
              row_scale.scalar_type() == torch::kFloat32 && col_scale.scalar_type() == torch::kFloat32,
              "w8a8_dequantize: fp32 scales [M], [N]");
  auto out = torch::empty({y.size(0), y.size(1)}, like.options());
  if (y.scalar_type() == torch::kInt32) {
    dequantize_as<int32_t>(y, row_scale, col_scale, out);
  } else {
    dequantize_as<float>(y, row_scale, col_scale, out);
  }
  return out;
}

// y [>= M, 2n] gate_up sums (int32 or fp32), row_scale [M], col_scale [2n], smooth [n] (the next linear's inverse
// factors), like: the model dtype -> (int8 [max(M, pad_rows), n] with zero rows past M, [M] fp32 scales)
std::tuple<torch::Tensor, torch::Tensor> w8a8_silu_mul_quantize(torch::Tensor y, torch::Tensor row_scale,
                                                                torch::Tensor col_scale, torch::Tensor smooth,
                                                                torch::Tensor like, int64_t pad_rows) {
  const int64_t M = row_scale.numel(), n = smooth.numel();
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) >= M && y.size(1) == 2 * n &&
              (y.scalar_type() == torch::kInt32 || y.scalar_type() == torch::kFloat32),
              "w8a8_silu_mul_quantize: int32 or fp32 sums [>= M, 2n]");
  TORCH_CHECK(row_scale.scalar_type() == torch::kFloat32 && col_scale.scalar_type() == torch::kFloat32 &&
              smooth.scalar_type() == torch::kFloat32 && col_scale.numel() == 2 * n && smooth.is_contiguous() &&
              col_scale.is_contiguous() && row_scale.is_contiguous(),
              "w8a8_silu_mul_quantize: fp32 scales [M], [2n] and smoothing [n]");
  auto q = padded_codes(M, pad_rows, n, y.options());
  auto qs = torch::empty({M}, y.options().dtype(torch::kFloat32));
  const float *rs = row_scale.data_ptr<float>(), *cs = col_scale.data_ptr<float>(), *sm = smooth.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* qsp = qs.data_ptr<float>();
  const bool bf16 = like.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || like.scalar_type() == torch::kFloat32, "w8a8_silu_mul_quantize: bfloat16 or float32");
  if (y.scalar_type() == torch::kInt32) {
    if (bf16) w8a8::silu_mul_quantize<at::BFloat16>(y.data_ptr<int32_t>(), rs, cs, sm, qp, qsp, M, n);
    else w8a8::silu_mul_quantize<float>(y.data_ptr<int32_t>(), rs, cs, sm, qp, qsp, M, n);
  } else {
    if (bf16) w8a8::silu_mul_quantize<at::BFloat16>(y.data_ptr<float>(), rs, cs, sm, qp, qsp, M, n);
    else w8a8::silu_mul_quantize<float>(y.data_ptr<float>(), rs, cs, sm, qp, qsp, M, n);
  }
  return {q, qs};
}
