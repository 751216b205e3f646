// 8-bit KV pages (worker.kvcache.quant): int8 rows, one fp32 scale per (kv head, page) for K and one for V; an
// element is int8 x its page's scale. Concatenated after vec_exp.h: the attention kernels read caches through these.
#include <torch/extension.h>
#include <cstdint>

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
