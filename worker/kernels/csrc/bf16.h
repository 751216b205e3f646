// bf16 <-> fp32 by bit operations, so loops over them vectorize (c10's conversions keep them scalar).
// Every kernel source uses these.
#pragma once
#include "aten.h"
#include <cstdint>
#include <cstring>

static inline float to_f(float v) { return v; }
static inline float to_f(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T> static inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline at::BFloat16 from_f<at::BFloat16>(float v) {  // round to nearest even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
}

#if defined(__AVX512F__)
#include <immintrin.h>
// 16 bf16 values widened to fp32 lanes, and 16 fp32 lanes rounded to bf16 as `from_f` rounds them (nearest even)
static inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline void store_bf16x16(at::BFloat16* o, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif
