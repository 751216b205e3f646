// W8A8 linears on AVX2 without int8 dot-product instructions (AMD Zen 3 and other AVX2-only CPUs), any row count:
// int8 activations times int8 weights packed once at load, 32 products per `vpmaddubsw` + `vpmaddwd` pair, as
// llama.cpp's AVX2 Q8_0 path does. `vpmaddubsw` takes unsigned x signed bytes and saturates pairs at 16 bits, so the
// activation's sign moves onto the weight (`vpsignb`) and |x|, |w| <= 127 keep each pair below 2^15: the int32 sums
// equal _int_mm's exactly, and the dequantization is the same fp32 expression, so outputs are bit-identical to the
// _int_mm path. Built on every CPU with AVX2 (so its tests run everywhere); chosen where there is no VNNI.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace w8a8_avx2 {

constexpr int64_t kLanes = 8;  // output channels per block (one ymm of int32 sums)
// rows per int16-product tile (4 x 2 accumulators; 5 measured the same and 6 slower on AMD Zen 3)
constexpr int kWideTile = 4;
// row counts from which the int16 products run: 0.8-1.0x the `vpmaddubsw` kernel's time at 512 rows on AMD Zen 3
// (interleaved in one process), even at 16, slower below 8 (w8a8_avx2_wide_rows changes it: tests, measurement)
static int64_t kWideRows = 32;

#if defined(__AVX2__)
constexpr bool kBuilt = true;

// One row's 8 int32 sums -> out row o[0, 8): sum * row scale * column scale in fp32, rounded to T (the _int_mm path's
// expression, so both tiles below give its bits)
template <typename T>
static inline void store_row(__m256i sums, float row_scale, __m256 cs, T* o) {
  alignas(32) float v[kLanes];
  _mm256_store_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(row_scale)), cs));
  for (int64_t c = 0; c < kLanes; ++c) o[c] = from_f<T>(v[c]);
}

// Rows [m0, m0 + MT) against the NB channel blocks starting at `w` (each block K * 8 bytes apart), then the
// dequantization into out[m][n0 ...].
template <typename T, int MT, int NB>
static inline void tile(const int8_t* xq, const int8_t* w, const float* row_scale, const float* col_scale,
                                T* out, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m256i acc[MT][NB];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = K / 4, block_bytes = K * kLanes;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * block_bytes + g * 32));
    for (int i = 0; i < MT; ++i) {
      int32_t four;
      std::memcpy(&four, xq + (m0 + i) * K + 4 * g, 4);
      const __m256i xs = _mm256_set1_epi32(four);
      const __m256i xa = _mm256_abs_epi8(xs);
      for (int j = 0; j < NB; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[j], xs));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j * kLanes;
    const __m256 cs = _mm256_loadu_ps(col_scale + n);
    for (int i = 0; i < MT; ++i) store_row<T>(acc[i][j], row_scale[m0 + i], cs, out + (m0 + i) * N + n);
  }
}

// tile<T, 4, 2> (the few-row path's main tile: 4 rows x 16 channels, decode steps) written as tile16x4 below is,
// for the same reason (two of its accumulators were kept on the stack): the eight accumulators as named variables,
// a register barrier after each row, one index for weights and rows.
template <typename T>
static inline void tile4x2(const int8_t* xq, const int8_t* w, const float* row_scale, const float* col_scale, T* out,
                           int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  const int8_t* r0 = xq + m0 * K;
  const int8_t* r1 = r0 + K;
  const int8_t* r2 = r1 + K;
  const int8_t* r3 = r2 + K;
  const int8_t* w0 = w;                // block 0: 32 bytes a group of 4 k, at w0 + 8k
  const int8_t* w1 = w + K * kLanes;   // block 1
  const __m256i ones = _mm256_set1_epi16(1);
#define SY_ROW8(acc0, acc1, r)                                                                        \
  {                                                                                                  \
    int32_t four;                                                                                    \
    std::memcpy(&four, r + k, 4);                                                                    \
    const __m256i xs = _mm256_set1_epi32(four);                                                      \
    const __m256i xa = _mm256_abs_epi8(xs);                                                          \
    acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv0, xs)), ones)); \
    acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv1, xs)), ones)); \
    __asm__("" : "+x"(acc0), "+x"(acc1));                                                            \
  }
  for (int64_t k = 0; k < K; k += 4) {
    const __m256i wv0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + 8 * k));
    const __m256i wv1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + 8 * k));
    SY_ROW8(a00, a01, r0) SY_ROW8(a10, a11, r1) SY_ROW8(a20, a21, r2) SY_ROW8(a30, a31, r3)
  }
#undef SY_ROW8
  const __m256i acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
  for (int j = 0; j < 2; ++j) {
    const int64_t n = n0 + j * kLanes;
    const __m256 cs = _mm256_loadu_ps(col_scale + n);
    for (int i = 0; i < 4; ++i) store_row<T>(acc[i][j], row_scale[m0 + i], cs, out + (m0 + i) * N + n);
  }
}

// The same product for many rows, by int16 multiplies: `vpmaddubsw` needs the `vpsignb` per row and block above,
// `vpmaddwd` on sign-extended codes does not. One block of 8 channels: each 4-k group's 32 bytes become two vectors
// of 4 channels x 4 k in int16 (`vpmovsxbw`, once per MT rows), the row's 4 codes (pre-widened to int16) are
// broadcast, and each channel's sum lands in two int32 lanes, added at the end. Exact, as above.
template <typename T, int MT>
static inline void tile16(const int16_t* x16, const int8_t* w, const float* row_scale, const float* col_scale,
                          T* out, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m256i lo[MT], hi[MT];
  for (int i = 0; i < MT; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
  const int64_t groups = K / 4;
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i* p = reinterpret_cast<const __m128i*>(w + g * 32);
    const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));      // channels 0-3, k 0-3
    const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));  // channels 4-7
    for (int i = 0; i < MT; ++i) {
      int64_t four;
      std::memcpy(&four, x16 + (m0 + i) * K + 4 * g, 8);
      const __m256i xs = _mm256_set1_epi64x(four);
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(wl, xs));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(wh, xs));
    }
  }
  const __m256 cs = _mm256_loadu_ps(col_scale + n0);
  for (int i = 0; i < MT; ++i) {
    // lanes (2c, 2c + 1) of lo / hi hold channel c's two partial sums: pairwise adds give [c0 c1 c4 c5 | c2 c3 c6 c7]
    const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[i], hi[i]), 0xD8);
    store_row<T>(sums, row_scale[m0 + i], cs, out + (m0 + i) * N + n0);
  }
}

// tile16 for 4 rows (the wide path's tile), with each accumulator a named variable and each row's two updates ended
// by an empty asm that keeps them in registers: from the loop above GCC computed all rows' products of a group
// before adding any, ran out of the 16 ymm registers and kept accumulators (and the weight pointer) on the stack, a
// store-to-load chain in every group. The same sums, so the same bits; on AMD Zen 3 (2 threads, default model
// shapes, 256-512 rows) 58-94 GMAC/s before, 103-126 after.
template <typename T>
static inline void tile16x4(const int16_t* x16, const int8_t* w, const float* row_scale, const float* col_scale,
                            T* out, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
  const int16_t* r0 = x16 + m0 * K;
  const int16_t* r1 = r0 + K;
  const int16_t* r2 = r1 + K;
  const int16_t* r3 = r2 + K;
  // one index k for the weights (32 bytes a group: w + 8k) and the rows (four codes: r + k), so both are base plus
  // scaled index: a pointer bumped in the loop was kept on the stack (no register left), a store-to-load chain
#define SY_ROW16(lo, hi, r)                                     \
  {                                                             \
    int64_t four;                                               \
    std::memcpy(&four, r + k, 8);                               \
    const __m256i xs = _mm256_set1_epi64x(four);                \
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(wl, xs));       \
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(wh, xs));       \
    __asm__("" : "+x"(lo), "+x"(hi));                           \
  }
  for (int64_t k = 0; k < K; k += 4) {
    const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * k)));  // ch 0-3
    const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * k + 16)));
    SY_ROW16(lo0, hi0, r0) SY_ROW16(lo1, hi1, r1) SY_ROW16(lo2, hi2, r2) SY_ROW16(lo3, hi3, r3)
  }
#undef SY_ROW16
  const __m256 cs = _mm256_loadu_ps(col_scale + n0);
  const __m256i los[4] = {lo0, lo1, lo2, lo3}, his[4] = {hi0, hi1, hi2, hi3};
  for (int i = 0; i < 4; ++i) {
    const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(los[i], his[i]), 0xD8);
    store_row<T>(sums, row_scale[m0 + i], cs, out + (m0 + i) * N + n0);
  }
}

// rows [m0, m0 + MT) over channel blocks [b0, b1)
template <typename T, int MT>
static void rows(const int8_t* xq, const int8_t* packed, const float* rs, const float* cs, T* out, int64_t K,
                 int64_t N, int64_t m0, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) {
    if constexpr (MT == 4) tile4x2<T>(xq, packed + b * K * kLanes, rs, cs, out, K, N, m0, b * kLanes);
    else tile<T, MT, 2>(xq, packed + b * K * kLanes, rs, cs, out, K, N, m0, b * kLanes);
  }
  for (; b < b1; ++b) tile<T, MT, 1>(xq, packed + b * K * kLanes, rs, cs, out, K, N, m0, b * kLanes);
}

template <typename T, int MT>
static void rows16(const int16_t* x16, const int8_t* packed, const float* rs, const float* cs, T* out, int64_t K,
                   int64_t N, int64_t m0, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (MT == 4) tile16x4<T>(x16, packed + b * K * kLanes, rs, cs, out, K, N, m0, b * kLanes);
    else tile16<T, MT>(x16, packed + b * K * kLanes, rs, cs, out, K, N, m0, b * kLanes);
  }
}

// M >= kWideRows: int16 products over codes widened once (x16 [M, K]). Tasks of 64 rows x 64 channels go to the
// threads from a shared counter, a channel slice's row chunks in a row (its weights stay in cache): with half the
// channels per thread, the threads waited on each other for 12% of a prefill step on a shared 2-core VM.
template <typename T>
static void linear16(const int16_t* x16, const int8_t* packed, const float* rs, const float* cs, T* out, int64_t M,
                     int64_t K, int64_t N) {
  constexpr int64_t kRowChunk = 64, kBlockChunk = 8;
  const int64_t blocks = N / kLanes, row_tiles = (M + kRowChunk - 1) / kRowChunk;
  const int64_t tasks = row_tiles * ((blocks + kBlockChunk - 1) / kBlockChunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t b0 = (t / row_tiles) * kBlockChunk, b1 = std::min(blocks, b0 + kBlockChunk);
      const int64_t r0 = (t % row_tiles) * kRowChunk, r1 = std::min(M, r0 + kRowChunk);
      int64_t m = r0;
      for (; m + kWideTile <= r1; m += kWideTile) rows16<T, kWideTile>(x16, packed, rs, cs, out, K, N, m, b0, b1);
      for (; m < r1; ++m) rows16<T, 1>(x16, packed, rs, cs, out, K, N, m, b0, b1);
    }
  });
}

template <typename T>
static void linear(const int8_t* xq, const int8_t* packed, const float* rs, const float* cs, T* out, int64_t M,
                   int64_t K, int64_t N) {
  const int64_t blocks = N / kLanes;
  constexpr int64_t kRowChunk = 64;  // rows per pass over a thread's blocks: their codes stay in L1/L2
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
      const int64_t r1 = std::min(M, r0 + kRowChunk);
      int64_t m = r0;
      for (; m + 4 <= r1; m += 4) rows<T, 4>(xq, packed, rs, cs, out, K, N, m, b0, b1);
      switch (r1 - m) {
        case 3: rows<T, 3>(xq, packed, rs, cs, out, K, N, m, b0, b1); break;
        case 2: rows<T, 2>(xq, packed, rs, cs, out, K, N, m, b0, b1); break;
        case 1: rows<T, 1>(xq, packed, rs, cs, out, K, N, m, b0, b1); break;
        default: break;
      }
    }
  });
}
// x [M, K] -> out [M, N]: per-row int8 codes of x * inv_smooth (q, rs: scratch), then the product by the kernel for M
template <typename T>
static void forward(const T* x, const float* smooth, const int8_t* packed, const float* cs, T* out, int8_t* q,
                    float* rs, int64_t M, int64_t K, int64_t N) {
  w8a8::quantize<T>(x, smooth, q, rs, M, K);
  if (M < kWideRows) {
    linear<T>(q, packed, rs, cs, out, M, K, N);
    return;
  }
  std::vector<int16_t> x16(q, q + M * K);  // the codes widened once
  linear16<T>(x16.data(), packed, rs, cs, out, M, K, N);
}

// W8A16: x [M, K] -> int16 codes per row (`w8a8::quantize_a16`), then the int16 products
template <typename T>
static void forward_a16(const T* x, const int8_t* packed, const float* cs, T* out, int64_t M, int64_t K, int64_t N,
                        int64_t bound) {
  std::vector<int16_t> x16(M * K);
  std::vector<float> rs(M);
  w8a8::quantize_a16(x, x16.data(), rs.data(), M, K, bound);
  linear16<T>(x16.data(), packed, rs.data(), cs, out, M, K, N);
}
#else
constexpr bool kBuilt = false;
#endif

// what both entry points take: the kernel built, x [M, K] bf16/fp32 rows, the packed weight for K, fp32 col_scale [N]
static void check_args(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                       const torch::Tensor& col_scale) {
  TORCH_CHECK(kBuilt, name, ": built without AVX2");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.dim() == 3 && packed.size(2) == 32 &&
              packed.size(1) * 4 == x.size(1), name, ": x [M, K], packed [N / 8, K / 4, 32]");
  TORCH_CHECK(col_scale.numel() == packed.size(0) * 8 && col_scale.scalar_type() == torch::kFloat32,
              name, ": col_scale fp32 [N]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              name, ": bfloat16 or float32");
}

}  // namespace w8a8_avx2

bool w8a8_avx2_available() { return w8a8_avx2::kBuilt; }

// the row count from which w8a8_avx2_linear multiplies in int16 (the same sums; for tests and measurement)
int64_t w8a8_avx2_wide_rows(int64_t rows) {
#if defined(__AVX2__)
  if (rows > 0) w8a8_avx2::kWideRows = rows;
  return w8a8_avx2::kWideRows;
#else
  return rows;
#endif
}

// wt [K, N] int8 (the _int_mm operand) -> packed [N / 8, K / 4, 32] int8: block b, group g, lane c, byte j holds
// wt[4g + j][8b + c]
torch::Tensor w8a8_avx2_pack(torch::Tensor wt) {
  TORCH_CHECK(wt.dim() == 2 && wt.scalar_type() == torch::kInt8, "w8a8_avx2_pack: int8 [K, N]");
  const int64_t K = wt.size(0), N = wt.size(1);
  TORCH_CHECK(K % 4 == 0 && N % 8 == 0, "w8a8_avx2_pack: K % 4 == 0 and N % 8 == 0");
  return wt.view({K / 4, 4, N / 8, 8}).permute({2, 0, 3, 1}).contiguous().view({N / 8, K / 4, 32});
}

// x [M, K] bf16/fp32 -> [M, N] of x's dtype: per-row int8 quantization of x * inv_smooth (as w8a8_quantize), then
// the product with the packed weight and the per-row / per-column scales.
torch::Tensor w8a8_avx2_linear(torch::Tensor x, torch::Tensor inv_smooth, torch::Tensor packed,
                               torch::Tensor col_scale) {
  w8a8_avx2::check_args("w8a8_avx2_linear", x, packed, col_scale);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 8;
  TORCH_CHECK(inv_smooth.scalar_type() == torch::kFloat32 && inv_smooth.numel() == K,
              "w8a8_avx2_linear: fp32 inv_smooth [K]");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto rs = torch::empty({M}, x.options().dtype(torch::kFloat32));
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX2__)
  const float* smooth = inv_smooth.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* cs = col_scale.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* rp = rs.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16)
    w8a8_avx2::forward<at::BFloat16>(x.data_ptr<at::BFloat16>(), smooth, wp, cs, out.data_ptr<at::BFloat16>(), qp, rp,
                                     M, K, N);
  else
    w8a8_avx2::forward<float>(x.data_ptr<float>(), smooth, wp, cs, out.data_ptr<float>(), qp, rp, M, K, N);
#endif
  return out;
}

// W8A16 (int8 weight-only linears, e.g. the LM head, on AVX2): x [M, K] bf16/fp32 -> [M, N] of x's dtype. The rows
// are quantized to int16 per row (`a16_bound`: finer than bf16's 8-bit mantissa below K = 16k), then multiplied by
// the int8 weight packed by w8a8_avx2_pack (the weight's transpose) in the int16 products above; col_scale is the
// weight's per-channel scale in fp32.
torch::Tensor w8a16_avx2_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale) {
  w8a8_avx2::check_args("w8a16_avx2_linear", x, packed, col_scale);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 8;
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX2__)
  const int64_t bound = w8a8::a16_bound(K);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* cs = col_scale.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16)
    w8a8_avx2::forward_a16<at::BFloat16>(x.data_ptr<at::BFloat16>(), wp, cs, out.data_ptr<at::BFloat16>(), M, K, N,
                                         bound);
  else
    w8a8_avx2::forward_a16<float>(x.data_ptr<float>(), wp, cs, out.data_ptr<float>(), M, K, N, bound);
#endif
  return out;
}

// the largest |code| w8a16_avx2_linear gives a row of K features (tests)
int64_t w8a16_avx2_bound(int64_t K) { return w8a8::a16_bound(K); }
