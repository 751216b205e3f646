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
