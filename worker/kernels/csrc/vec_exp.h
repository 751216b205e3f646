// exp(x) written so that loops over it vectorize (std::exp is a scalar call): Cody-Waite range reduction and a
// degree-6 polynomial (Cephes' expf), within 2 ulp of expf over the range that matters. Concatenated after
// bf16.h by worker/kernels/cpu.py; used by the SiLU (fused_ops.cpp) and the softmaxes of the attention kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
    const float m = row_max(sj, L);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < L; ++t) { const float e = vec_exp(sj[t] - m); sj[t] = e; sum += e; }
    denom[j] = sum;
  }
}
