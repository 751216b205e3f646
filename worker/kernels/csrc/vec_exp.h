// exp(x) written so that loops over it vectorize (std::exp is a scalar call): Cody-Waite range reduction and a
// degree-6 polynomial (Cephes' expf), within 2 ulp of expf over the range that matters.
// Used by the SiLU (fused_ops.cpp) and the softmaxes of the attention kernels.
#pragma once
#include "aten.h"
#include "bf16.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float vec_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r * r + r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__)
// vec_exp in 8 lanes, written out: GCC left `omp simd` loops over vec_exp scalar (the objects for -march=native on
// Zen 3 and for -march=sapphirerapids alike), which made the prefill softmax half of that kernel's time on Zen 3
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 shift = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift), shift);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
// exp8's operations in 16 lanes (the same results lane for lane)
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 shift = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// x[0, L) = exp(x - m) in place; returns their sum
static inline float exp_row(float* x, int64_t L, float m) {
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 vm16 = _mm512_set1_ps(m);
  __m512 acc16 = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), vm16));
    _mm512_storeu_ps(x + t, e);
    acc16 = _mm512_add_ps(acc16, e);
  }
  sum = _mm512_reduce_add_ps(acc16);
#endif
#if defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), vm));
    _mm256_storeu_ps(x + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float e : lanes) sum += e;
#endif
  for (; t < L; ++t) { const float e = vec_exp(x[t] - m); x[t] = e; sum += e; }  // AVX-512: 16 lanes, then 8
  return sum;
}

// o[d] = silu(g[d]) * u[d] = g / (1 + exp(-g)) * u over fp32 rows (the same expression as the scalar loops)
static inline void silu_mul_f32(const float* g, const float* u, float* o, int64_t n) {
  int64_t d = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; d + 8 <= n; d += 8) {
    const __m256 gv = _mm256_loadu_ps(g + d);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + d)));
  }
#endif
  for (; d < n; ++d) o[d] = g[d] / (1.f + vec_exp(-g[d])) * u[d];
}

// o[d] = silu(g[d]) * u[d] in T, math in fp32 and rounded once: fp32 rows in AVX2 lanes, bf16 rows in AVX-512
// lanes where built, others (and the tails) by the plain loop
template <typename T>
static inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    silu_mul_f32(g, u, o, n);
  } else {
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // bf16 rows in 16 lanes: the `omp simd` loop below stays scalar (GCC does not vectorize over vec_exp)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const __m512 one = _mm512_set1_ps(1.f);
      for (; d + 16 <= n; d += 16) {
        const __m512 gv = load_bf16x16(g + d);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        store_bf16x16(o + d, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), load_bf16x16(u + d)));
      }
    }
#endif
    for (; d < n; ++d) {
      const float gv = to_f(g[d]);
      o[d] = from_f<T>(gv / (1.f + vec_exp(-gv)) * to_f(u[d]));
    }
  }
}

// Softmax numerators and denominators of `rows` rows of `L` scores each (row j at scores + j * L): each score
// becomes exp(score - its row's max) in place, and denom[j] the row's sum. Shared by the decode kernels.
// The largest of x[0..L) (-inf for L = 0), in vector registers: `omp simd reduction(max)` over std::max compiled to
// a scalar loop, 11% of the int8 decode kernel's time at 2k context.
static inline float row_max(const float* x, int64_t L) {
  float m = -INFINITY;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 v = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= L; t += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + t));
  m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
  __m256 v = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= L; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float e : lanes) m = std::max(m, e);
#endif
  for (; t < L; ++t) m = std::max(m, x[t]);
  return m;
}

static inline void softmax_numerators(float* scores, int64_t rows, int64_t L, float* denom) {
  for (int64_t j = 0; j < rows; ++j) {
    float* sj = scores + j * L;
    denom[j] = exp_row(sj, L, row_max(sj, L));
  }
}
