// Paged decode attention for CPU: K/V read straight from the pages, one (sequence, kv head) per task.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static void decode_impl(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,
                        T* out, int64_t B, int64_t nh, int64_t kvh, int64_t hd, int64_t slots,
                        int64_t max_pages, int64_t bs, float scale) {
  const int64_t g = nh / kvh;
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * hd), acc(g * hd), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t L = lens[b];
      scores.assign(g * L, 0.f);
      for (int64_t i = 0; i < g * hd; ++i) qf[i] = static_cast<float>(q[(b * nh + h * g) * hd + i]) * scale;
      const T* kbase = kc + h * slots * hd;
      const T* vbase = vc + h * slots * hd;
      const int64_t* table = tables + b * max_pages;
      for (int64_t t = 0; t < L; ++t) {
        const T* kr = kbase + (table[t / bs] * bs + t % bs) * hd;
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * hd;
          float s = 0.f;
          #pragma omp simd reduction(+:s)
          for (int64_t d = 0; d < hd; ++d) s += qj[d] * static_cast<float>(kr[d]);
          scores[j * L + t] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(g, 0.f);
      for (int64_t j = 0; j < g; ++j) {
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, scores[j * L + t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { float e = std::exp(scores[j * L + t] - m); scores[j * L + t] = e; sum += e; }
        denom[j] = sum;
      }
      for (int64_t t = 0; t < L; ++t) {
        const T* vr = vbase + (table[t / bs] * bs + t % bs) * hd;
        for (int64_t j = 0; j < g; ++j) {
          const float p = scores[j * L + t];
          float* aj = acc.data() + j * hd;
          #pragma omp simd
          for (int64_t d = 0; d < hd; ++d) aj[d] += p * static_cast<float>(vr[d]);
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < hd; ++d)
          out[(b * nh + h * g + j) * hd + d] = static_cast<T>(acc[j * hd + d] / denom[j]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor lens, int64_t bs, double scale) {
  // q [B, nh, hd]; kc, vc [kvh, slots, hd]; tables [B, max_pages] int64; lens [B] int64
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "contiguous inputs required");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "int64 tables and lens");
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kc.size(0), slots = kc.size(1);
  auto t = tables.contiguous();
  auto l = lens.contiguous();
  if (q.scalar_type() == torch::kBFloat16) {
    decode_impl<at::BFloat16>(q.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
                              t.data_ptr<int64_t>(), l.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(),
                              B, nh, kvh, hd, slots, t.size(1), bs, (float)scale);
  } else if (q.scalar_type() == torch::kFloat32) {
    decode_impl<float>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), t.data_ptr<int64_t>(),
                       l.data_ptr<int64_t>(), out.data_ptr<float>(), B, nh, kvh, hd, slots, t.size(1), bs,
                       (float)scale);
  } else {
    TORCH_CHECK(false, "paged_decode supports bfloat16 and float32");
  }
  return out;
}
