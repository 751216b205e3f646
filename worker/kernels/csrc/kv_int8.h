// 8-bit KV pages (worker.kvcache.quant): int8 rows, one fp32 scale per (kv head, page) for K and one for V; an
// element is int8 x its page's scale. The attention kernels read caches through these.
#pragma once
#include "aten.h"
#include "bf16.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

struct KvScales {  // null pointers: a model-dtype cache (every scale 1)
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t pages = 0;  // scales per kv head
};

static inline float to_f(int8_t v) { return static_cast<float>(v); }

constexpr int64_t kKvPrefetch = 4;  // pages ahead the int8 decode loops prefetch

static inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

// the scale of page `page` of kv head h in `s` ([kvh, pages] fp32), 1 for a model-dtype cache
static inline float page_scale(const float* s, int64_t pages, int64_t h, int64_t page) {
  return s == nullptr ? 1.f : s[h * pages + page];
}

static inline KvScales kv_scales(const torch::Tensor& ks, const torch::Tensor& vs, int64_t kvh) {
  TORCH_CHECK(ks.scalar_type() == torch::kFloat32 && vs.scalar_type() == torch::kFloat32 && ks.is_contiguous() &&
              vs.is_contiguous() && ks.dim() == 2 && ks.sizes() == vs.sizes() && ks.size(0) == kvh,
              "int8 KV: fp32 scales [kvh, pages]");
  return KvScales{ks.data_ptr<float>(), vs.data_ptr<float>(), ks.size(1)};
}

// Query row src[0..n) times `mul`, rounded to integers of at most `top` in magnitude with one scale for the row
// (returned: the factor that turns a code back into src x mul; 0 for a zero row). Shared by the int8 decode paths.
template <typename T, typename Q>
static inline float quantize_query(const T* src, float mul, float top, Q* dst, int64_t n) {
  float m = 0.f;
  for (int64_t d = 0; d < n; ++d) m = std::max(m, std::fabs(to_f(src[d])));
  const float inv = m > 0.f ? top / m : 0.f;
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<Q>(std::nearbyint(to_f(src[d]) * inv));
  return m / top * mul;
}

// The `rows` key rows of `width` elements at k, or, for a page's last n < rows of them, their copy in `part` with
// zero rows after it (rows past n may lie outside the page): score loops then run every row unconditionally and
// keep their accumulators in registers.
template <typename E>
static inline const E* key_block(const E* k, int64_t n, int64_t rows, int64_t width, E* part) {
  if (n >= rows) return k;
  std::memcpy(part, k, n * width * sizeof(E));
  std::memset(part + n * width, 0, (rows - n) * width * sizeof(E));
  return part;
}
