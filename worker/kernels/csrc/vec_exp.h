// exp(x) written so that loops over it vectorize (std::exp is a scalar call): Cody-Waite range reduction and a
// degree-6 polynomial (Cephes' expf), within 2 ulp of expf over the range that matters. Concatenated after
// bf16.h by worker/kernels/cpu.py; used by the SiLU (fused_ops.cpp) and the softmaxes of the attention kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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
static inline void softmax_numerators(float* scores, int64_t rows, int64_t L, float* denom) {
  for (int64_t j = 0; j < rows; ++j) {
    float* sj = scores + j * L;
    float m = -INFINITY;
    #pragma omp simd reduction(max:m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sj[t]);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < L; ++t) { const float e = vec_exp(sj[t] - m); sj[t] = e; sum += e; }
    denom[j] = sum;
  }
}
