// W8A8 linears for few rows (decode steps) on AVX-512 VNNI: the whole linear in one call, on weights packed once
// at load. `torch._int_mm` re-lays the [K, N] weight for oneDNN on every call, which dominates at decode sizes;
// here the weight is read once per call in the layout `vpdpbusd` consumes. The int32 sums equal _int_mm's exactly
// (activations are offset by 128 to unsigned and the offset removed with the packed column sums), and the
// dequantization is the same fp32 expression, so outputs are bit-identical to the _int_mm path.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace w8a8_small {

constexpr int64_t kLanes = 16;  // output channels per block (one zmm of int32 sums)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kBuilt = true;

static inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }

// 16 lanes to bf16 in vector registers (the scalar loop cost a third of the few-row kernel's time at 16 rows)
static inline void store16(at::BFloat16* o, __m512 v) { store_bf16x16(o, v); }

// 128 x the column sums of a channel block: what the activations' offset to unsigned bytes added to its sums
static inline __m512i offset128(const int32_t* colsum) { return _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7); }

// A channel block's exact int32 sums for one row into o[0, 16): times the row and the column scales.
template <typename T>
static inline void store_sums(__m512i sums, __m512 cs, float row_scale, T* o) {
  store16(o, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(row_scale)), cs));
}

// One channel block's offset sums for row m into out[m][n ...]: the 128 offset removed, then `store_sums`.
template <typename T>
static inline void store_block(__m512i acc, __m512i offset, __m512 cs, float row_scale, T* o) {
  store_sums(_mm512_sub_epi32(acc, offset), cs, row_scale, o);
}

// Rows [m0, m0 + MT) against the NB channel blocks starting at `w` (each block K * 16 bytes apart), then the
// dequantization into out[m][n0 ...].
template <typename T, int MT, int NB>
static inline void tile(const uint8_t* xu, const int8_t* w, const int32_t* colsum, const float* row_scale,
                        const float* col_scale, T* out, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512i acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t groups = K / 4, block_bytes = K * kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + g * 64);
    for (int i = 0; i < MT; ++i) {
      int32_t four;
      std::memcpy(&four, xu + (m0 + i) * K + 4 * g, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j * kLanes;
    const __m512i offset = offset128(colsum + n);
    const __m512 cs = _mm512_loadu_ps(col_scale + n);
    for (int i = 0; i < MT; ++i) store_block(acc[i][j], offset, cs, row_scale[m0 + i], out + (m0 + i) * N + n);
  }
}

static inline __m512i bcast4(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// a block pair's weight vectors at depth k (blocks w0, w1), prefetching the pair two ahead into L2: the strips
// (18-49 KB) are too short for the hardware prefetcher
static inline void pair_at(const int8_t* w0, const int8_t* w1, int64_t k, int64_t K, __m512i& v0, __m512i& v1) {
  const int64_t ahead = 4 * K * kLanes;
  v0 = _mm512_loadu_si512(w0 + 16 * k);
  v1 = _mm512_loadu_si512(w1 + 16 * k);
  _mm_prefetch(reinterpret_cast<const char*>(w0 + 16 * k + ahead), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(w1 + 16 * k + ahead), _MM_HINT_T1);
}

// `tile<T, 8, 2>` with its 16 accumulators named: as an array GCC kept one on the stack (a store-to-load chain
// in every group) and copied the others twice per group. Eight rows share each weight load, two blocks each
// activation broadcast: 10 loads for 16 vpdpbusd.
template <typename T>
static inline void tile8x2(const uint8_t* xu, const int8_t* w, const int32_t* colsum, const float* row_scale,
                           const float* col_scale, T* out, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  const __m512i z = _mm512_setzero_si512();
  __m512i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
  __m512i a40 = z, a41 = z, a50 = z, a51 = z, a60 = z, a61 = z, a70 = z, a71 = z;
  const uint8_t* x = xu + m0 * K;
  const int8_t* w1 = w + K * kLanes;
  for (int64_t k = 0; k < K; k += 4) {
    __m512i v0, v1;
    pair_at(w, w1, k, K, v0, v1);
#define SY_ROW(i)                                          \
  {                                                        \
    const __m512i a = bcast4(x + (i) * K + k);             \
    a##i##0 = _mm512_dpbusd_epi32(a##i##0, a, v0);         \
    a##i##1 = _mm512_dpbusd_epi32(a##i##1, a, v1);         \
  }
    SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3) SY_ROW(4) SY_ROW(5) SY_ROW(6) SY_ROW(7)
#undef SY_ROW
  }
  const __m512i off0 = offset128(colsum + n0), off1 = offset128(colsum + n0 + kLanes);
  const __m512 cs0 = _mm512_loadu_ps(col_scale + n0), cs1 = _mm512_loadu_ps(col_scale + n0 + kLanes);
  const __m512i acc[8][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31},
                             {a40, a41}, {a50, a51}, {a60, a61}, {a70, a71}};
  for (int i = 0; i < 8; ++i) {
    T* o = out + (m0 + i) * N + n0;
    store_block(acc[i][0], off0, cs0, row_scale[m0 + i], o);
    store_block(acc[i][1], off1, cs1, row_scale[m0 + i], o + kLanes);
  }
}

// rows [m0, m0 + MT) against channel blocks [b0, b1): four at a time, then two, then one
template <typename T, int MT>
static void rows(const uint8_t* xu, const int8_t* packed, const int32_t* colsum, const float* rs, const float* cs,
                 T* out, int64_t K, int64_t N, int64_t m0, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4)
    tile<T, MT, 4>(xu, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m0, b * kLanes);
  for (; b + 2 <= b1; b += 2)
    tile<T, MT, 2>(xu, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m0, b * kLanes);
  for (; b < b1; ++b) tile<T, MT, 1>(xu, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m0, b * kLanes);
}

template <typename T>
static void linear(const uint8_t* xu, const int8_t* packed, const int32_t* colsum, const float* rs, const float* cs,
                   T* out, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kLanes;
  // The channel blocks split between threads; each thread walks its blocks in strips against every row, so a
  // strip's weights come from memory once and from cache for the later rows (rows outermost re-read them per
  // four rows: 2x slower at 16 rows). From 8 rows, strips of two blocks in 8-row passes (`tile8x2`); below,
  // strips of four, whose 4-row tiles broadcast each activation against four weight vectors.
  const int64_t strip = M >= 8 ? 2 : 4;
  at::parallel_for(0, blocks, strip, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += strip) {
      const int64_t e = std::min(b + strip, b1);
      int64_t m = 0;
      if (strip == 2 && e - b == 2) {
        for (; m + 8 <= M; m += 8) tile8x2<T>(xu, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m, b * kLanes);
      }
      for (; m + 4 <= M; m += 4) rows<T, 4>(xu, packed, colsum, rs, cs, out, K, N, m, b, e);
      switch (M - m) {
        case 3: rows<T, 3>(xu, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        case 2: rows<T, 2>(xu, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        case 1: rows<T, 1>(xu, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        default: break;
      }
    }
  });
}
// W8A16 on VNNI (int8 weight-only linears such as the LM head, on int16 activation rows): a code c = 256 hi + lo
// goes in as two unsigned bytes, hi + 128 and lo, each multiplied by the weights in its own accumulator; the sum
// is ((sum_hi - 128 * column sum) << 8) + sum_lo, exact for codes within `w8a8::a16_bound` (the vector ops wrap
// modulo 2^32 and the true sum fits in int32): the same integers as w8a8_avx2.cpp's int16 products and the same
// dequantization, so the same bits.
template <typename T>
static inline void store_a16(__m512i hi, __m512i lo, __m512i offset, __m512 cs, float row_scale, T* o) {
  store_sums(_mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(hi, offset), 8), lo), cs, row_scale, o);
}

// rows [m0, m0 + MT) of the split codes (xh: hi + 128, xl: lo) against NB channel blocks from `w`
template <typename T, int MT, int NB>
static inline void a16_tile(const uint8_t* xh, const uint8_t* xl, const int8_t* w, const int32_t* colsum,
                            const float* row_scale, const float* col_scale, T* out, int64_t K, int64_t N,
                            int64_t m0, int64_t n0) {
  __m512i hi[MT][NB], lo[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) hi[i][j] = lo[i][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * K * kLanes + 16 * k);
    for (int i = 0; i < MT; ++i) {
      const __m512i ah = bcast4(xh + (m0 + i) * K + k), al = bcast4(xl + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) {
        hi[i][j] = _mm512_dpbusd_epi32(hi[i][j], ah, wv[j]);
        lo[i][j] = _mm512_dpbusd_epi32(lo[i][j], al, wv[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j * kLanes;
    const __m512i offset = offset128(colsum + n);
    const __m512 cs = _mm512_loadu_ps(col_scale + n);
    for (int i = 0; i < MT; ++i)
      store_a16(hi[i][j], lo[i][j], offset, cs, row_scale[m0 + i], out + (m0 + i) * N + n);
  }
}

// `a16_tile<T, 4, 2>` with its 16 accumulators named (see tile8x2), prefetching two block pairs ahead
template <typename T>
static inline void a16_tile4x2(const uint8_t* xh, const uint8_t* xl, const int8_t* w, const int32_t* colsum,
                               const float* row_scale, const float* col_scale, T* out, int64_t K, int64_t N,
                               int64_t m0, int64_t n0) {
  const __m512i z = _mm512_setzero_si512();
  __m512i h00 = z, h01 = z, h10 = z, h11 = z, h20 = z, h21 = z, h30 = z, h31 = z;
  __m512i l00 = z, l01 = z, l10 = z, l11 = z, l20 = z, l21 = z, l30 = z, l31 = z;
  const uint8_t* ph = xh + m0 * K;
  const uint8_t* pl = xl + m0 * K;
  const int8_t* w1 = w + K * kLanes;
  for (int64_t k = 0; k < K; k += 4) {
    __m512i v0, v1;
    pair_at(w, w1, k, K, v0, v1);
#define SY_ROW(i)                                                                        \
  {                                                                                      \
    const __m512i ah = bcast4(ph + (i) * K + k), al = bcast4(pl + (i) * K + k);          \
    h##i##0 = _mm512_dpbusd_epi32(h##i##0, ah, v0);                                      \
    h##i##1 = _mm512_dpbusd_epi32(h##i##1, ah, v1);                                      \
    l##i##0 = _mm512_dpbusd_epi32(l##i##0, al, v0);                                      \
    l##i##1 = _mm512_dpbusd_epi32(l##i##1, al, v1);                                      \
  }
    SY_ROW(0) SY_ROW(1) SY_ROW(2) SY_ROW(3)
#undef SY_ROW
  }
  const __m512i off0 = offset128(colsum + n0), off1 = offset128(colsum + n0 + kLanes);
  const __m512 cs0 = _mm512_loadu_ps(col_scale + n0), cs1 = _mm512_loadu_ps(col_scale + n0 + kLanes);
  const __m512i hs[4][2] = {{h00, h01}, {h10, h11}, {h20, h21}, {h30, h31}};
  const __m512i ls[4][2] = {{l00, l01}, {l10, l11}, {l20, l21}, {l30, l31}};
  for (int i = 0; i < 4; ++i) {
    T* o = out + (m0 + i) * N + n0;
    store_a16(hs[i][0], ls[i][0], off0, cs0, row_scale[m0 + i], o);
    store_a16(hs[i][1], ls[i][1], off1, cs1, row_scale[m0 + i], o + kLanes);
  }
}

template <typename T, int MT>
static void a16_rows(const uint8_t* xh, const uint8_t* xl, const int8_t* packed, const int32_t* colsum,
                     const float* rs, const float* cs, T* out, int64_t K, int64_t N, int64_t m0, int64_t b,
                     int64_t e) {
  for (; b + 2 <= e; b += 2)
    a16_tile<T, MT, 2>(xh, xl, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m0, b * kLanes);
  if (b < e) a16_tile<T, MT, 1>(xh, xl, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m0, b * kLanes);
}

// every row against block pairs split between threads: 4-row passes, then the 1-3 rows left
template <typename T>
static void linear_a16(const uint8_t* xh, const uint8_t* xl, const int8_t* packed, const int32_t* colsum,
                       const float* rs, const float* cs, T* out, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N / kLanes, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += 2) {
      const int64_t e = std::min(b + 2, b1);
      int64_t m = 0;
      if (e - b == 2) {
        for (; m + 4 <= M; m += 4)
          a16_tile4x2<T>(xh, xl, packed + b * K * kLanes, colsum, rs, cs, out, K, N, m, b * kLanes);
      }
      for (; m + 4 <= M; m += 4) a16_rows<T, 4>(xh, xl, packed, colsum, rs, cs, out, K, N, m, b, e);
      switch (M - m) {
        case 3: a16_rows<T, 3>(xh, xl, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        case 2: a16_rows<T, 2>(xh, xl, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        case 1: a16_rows<T, 1>(xh, xl, packed, colsum, rs, cs, out, K, N, m, b, e); break;
        default: break;
      }
    }
  });
}
#else
constexpr bool kBuilt = false;
#endif

// what both entry points take: the kernel built, x [M, K] bf16/fp32 rows, the weight packed for K, int32 column
// sums and fp32 scales [N]
static void check_args(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                       const torch::Tensor& colsum, const torch::Tensor& col_scale) {
  TORCH_CHECK(kBuilt, name, ": built without AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.dim() == 3 && packed.size(2) == 64 &&
              packed.size(1) * 4 == x.size(1), name, ": x [M, K], packed [N / 16, K / 4, 64]");
  const int64_t N = packed.size(0) * 16;
  TORCH_CHECK(colsum.numel() == N && col_scale.numel() == N && colsum.scalar_type() == torch::kInt32 &&
              col_scale.scalar_type() == torch::kFloat32, name, ": colsum int32 [N], col_scale fp32 [N]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              name, ": bfloat16 or float32");
}

}  // namespace w8a8_small

bool w8a8_small_available() { return w8a8_small::kBuilt; }

// wt [K, N] int8 (the _int_mm operand) -> (packed [N / 16, K / 4, 64] int8: block b, group g, lane c, byte j holds
// wt[4g + j][16b + c]; column sums [N] int32)
std::tuple<torch::Tensor, torch::Tensor> w8a8_small_pack(torch::Tensor wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == torch::kInt8, "w8a8_small_pack: int8 [K, N]");
  const int64_t K = wt.size(0), N = wt.size(1);
  TORCH_CHECK(K % 4 == 0 && N % 16 == 0, "w8a8_small_pack: K % 4 == 0 and N % 16 == 0");
  auto w = wt.view({K / 4, 4, N / 16, 16}).permute({2, 0, 3, 1}).contiguous().view({N / 16, K / 4, 64});
  return {w, wt.to(torch::kInt32).sum(0, false, torch::kInt32).contiguous()};
}

// x [M, K] bf16/fp32 -> [M, N] of x's dtype: per-row int8 quantization of x * inv_smooth (as w8a8_quantize), then
// the product with the packed weight and the per-row / per-column scales.
torch::Tensor w8a8_small_linear(torch::Tensor x, torch::Tensor inv_smooth, torch::Tensor packed, torch::Tensor colsum,
                                torch::Tensor col_scale) {
  w8a8_small::check_args("w8a8_small_linear", x, packed, colsum, col_scale);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(inv_smooth.scalar_type() == torch::kFloat32 && inv_smooth.numel() == K,
              "w8a8_small_linear: fp32 inv_smooth [K]");
  // codes as in w8a8_quantize, offset to unsigned for vpdpbusd (u8 x s8): q + 128 == q ^ 0x80 as a byte
  thread_local std::vector<uint8_t> xu;
  thread_local std::vector<float> rs;
  xu.resize(M * K);
  rs.resize(M);
  int8_t* q = reinterpret_cast<int8_t*>(xu.data());
  const float* smooth = inv_smooth.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    rs[m] = x.scalar_type() == torch::kBFloat16
                ? w8a8::quantize_row(x.data_ptr<at::BFloat16>() + m * K, smooth, q + m * K, K)
                : w8a8::quantize_row(x.data_ptr<float>() + m * K, smooth, q + m * K, K);
  }
  for (auto& b : xu) b ^= 0x80;
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const uint8_t* xp = xu.data();
  const int8_t* wp = packed.data_ptr<int8_t>();
  if (x.scalar_type() == torch::kBFloat16) {
    w8a8_small::linear<at::BFloat16>(xp, wp, colsum.data_ptr<int32_t>(), rs.data(),
                                     col_scale.data_ptr<float>(), out.data_ptr<at::BFloat16>(), M, K, N);
  } else {
    w8a8_small::linear<float>(xp, wp, colsum.data_ptr<int32_t>(), rs.data(), col_scale.data_ptr<float>(),
                              out.data_ptr<float>(), M, K, N);
  }
#endif
  return out;
}

// W8A16 on VNNI: x [M, K] bf16/fp32 -> [M, N] of x's dtype, for an int8 weight-only linear (the LM head) whose
// weight (the transpose of its int8 [N, K]) `w8a8_small_pack` packed; col_scale is the weight's per-channel scale.
// The rows are quantized as w8a16_avx2_linear quantizes them, and the outputs are its bits.
torch::Tensor w8a16_small_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor colsum, torch::Tensor col_scale) {
  w8a8_small::check_args("w8a16_small_linear", x, packed, colsum, col_scale);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  thread_local std::vector<int16_t> q;
  thread_local std::vector<uint8_t> xh, xl;
  thread_local std::vector<float> rs;
  q.resize(M * K);
  xh.resize(M * K);
  xl.resize(M * K);
  rs.resize(M);
  const int64_t bound = w8a8::a16_bound(K);
  if (x.scalar_type() == torch::kBFloat16)
    w8a8::quantize_a16(x.data_ptr<at::BFloat16>(), q.data(), rs.data(), M, K, bound);
  else
    w8a8::quantize_a16(x.data_ptr<float>(), q.data(), rs.data(), M, K, bound);
  for (int64_t i = 0; i < M * K; ++i) {
    xh[i] = static_cast<uint8_t>((q[i] >> 8) + 128);
    xl[i] = static_cast<uint8_t>(q[i] & 0xFF);
  }
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* sums = colsum.data_ptr<int32_t>();
  const float* cs = col_scale.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16)
    w8a8_small::linear_a16<at::BFloat16>(xh.data(), xl.data(), wp, sums, rs.data(), cs, out.data_ptr<at::BFloat16>(),
                                         M, K, N);
  else
    w8a8_small::linear_a16<float>(xh.data(), xl.data(), wp, sums, rs.data(), cs, out.data_ptr<float>(), M, K, N);
#endif
  return out;
}
