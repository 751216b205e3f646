// 8-bit KV pages: the write that quantizes a step's new K/V rows in place (paged_decode_int8.cpp reads them).
//
// Scale rule (worker/kvcache/quant.py is the torch reference of the same arithmetic): symmetric absmax, one fp32
// scale per (kv head, page). Rows written from a page's first slot start it afresh (scale = absmax / 127); a row
// appended past a page's start whose absmax exceeds 127 x scale grows the scale to max(absmax / 127, GROW x scale)
// and requantizes the rows before it in place. Error: half a step per element for a page that never grows, at most
// GROW / (GROW - 1) / 2 steps of the final scale after any number of growths.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>

namespace kvq {

static inline int8_t quant(float x, float inv) {
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x * inv))));
}

template <typename T>
static inline float row_absmax(const T* row, int64_t n) {
  float m = 0.f;
  #pragma omp simd reduction(max:m)
  for (int64_t d = 0; d < n; ++d) m = std::max(m, std::fabs(to_f(row[d])));
  return m;
}

// tokens [t0, t1) of one page, head h of one cache (K or V): the scale rule above, then the rows quantized
template <typename T>
static void write_run(const T* src, int64_t src_stride, int64_t t0, int64_t t1, const int64_t* sm, int8_t* cache,
                      float* scales, int64_t h, int64_t slots, int64_t pages, int64_t bs, int64_t hd, float grow) {
  const int64_t page = sm[t0] / bs;
  int64_t first = bs;
  float amax = 0.f;
  for (int64_t t = t0; t < t1; ++t) {
    first = std::min(first, sm[t] % bs);
    amax = std::max(amax, row_absmax(src + t * src_stride, hd));
  }
  float& s = scales[h * pages + page];
  const float want = amax / 127.f;
  int8_t* base = cache + (h * slots + page * bs) * hd;
  if (first == 0) {
    s = want;  // a fresh page: nothing before the run is live
  } else if (want > s) {
    const float grown = std::max(want, s * grow), ratio = s / grown;
    for (int64_t i = 0; i < first * hd; ++i) base[i] = quant(static_cast<float>(base[i]), ratio);
    s = grown;
  }
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t t = t0; t < t1; ++t) {
    const T* x = src + t * src_stride;
    int8_t* dst = base + (sm[t] % bs) * hd;
    #pragma omp simd
    for (int64_t d = 0; d < hd; ++d) dst[d] = quant(to_f(x[d]), inv);
  }
}

template <typename T>
static void write_all(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc, torch::Tensor& vc,
                      torch::Tensor& ks, torch::Tensor& vs, const int64_t* sm, int64_t bs, float grow) {
  const int64_t T_ = k.size(0), kvh = k.size(1), hd = k.size(2), slots = kc.size(1), pages = ks.size(1);
  std::vector<int64_t> starts;  // runs of consecutive tokens on one page
  for (int64_t t = 0; t < T_; ++t)
    if (t == 0 || sm[t] / bs != sm[t - 1] / bs) starts.push_back(t);
  starts.push_back(T_);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, 2 * kvh, T_ >= 64 ? 1 : 2 * kvh, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const bool is_k = task < kvh;
      const int64_t h = task % kvh;
      const torch::Tensor& x = is_k ? k : v;
      const T* src = x.data_ptr<T>() + h * hd;
      int8_t* cache = (is_k ? kc : vc).data_ptr<int8_t>();
      float* sc = (is_k ? ks : vs).data_ptr<float>();
      for (int64_t r = 0; r < runs; ++r)
        write_run(src, x.stride(0), starts[r], starts[r + 1], sm, cache, sc, h, slots, pages, bs, hd, grow);
    }
  });
}

}  // namespace kvq

// k, v [T, kvh, hd] (contiguous heads; rows may be strided) in the model's dtype; kc, vc [kvh, slots, hd] int8;
// k_scale, v_scale [kvh, pages] fp32; slot_mapping [T] int64 (a sequence's tokens consecutive, as every step lays them)
void paged_kv_write_int8(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                         torch::Tensor v_scale, torch::Tensor slot_mapping, int64_t bs, double grow) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 3 && kc.sizes() == vc.sizes() &&
              k.size(1) == kc.size(0) && k.size(2) == kc.size(2), "paged_kv_write_int8: k, v [T, kvh, hd]");
  TORCH_CHECK(kc.scalar_type() == torch::kChar && vc.scalar_type() == torch::kChar && kc.is_contiguous() &&
              vc.is_contiguous() && k.scalar_type() == v.scalar_type() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "paged_kv_write_int8: contiguous heads, int8 caches");
  kv_scales(k_scale, v_scale, kc.size(0));
  TORCH_CHECK(kc.size(1) == k_scale.size(1) * bs, "paged_kv_write_int8: one scale per page");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == k.size(0) &&
              slot_mapping.is_contiguous(), "paged_kv_write_int8: int64 slot_mapping [T]");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < kc.size(1), "paged_kv_write_int8: slot out of range");
  if (k.scalar_type() == torch::kBFloat16)
    kvq::write_all<at::BFloat16>(k, v, kc, vc, k_scale, v_scale, sm, bs, static_cast<float>(grow));
  else if (k.scalar_type() == torch::kFloat32)
    kvq::write_all<float>(k, v, kc, vc, k_scale, v_scale, sm, bs, static_cast<float>(grow));
  else
    TORCH_CHECK(false, "paged_kv_write_int8 supports bfloat16 and float32");
}
