// The prefill kernel's entry points (paged_prefill.cpp): argument checks, the chunk list, the dtype dispatch.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <vector>

// q [T, nh, hd]: the prefill rows of a step, chunk after chunk; kc, vc [kvh, slots, hd] (q's dtype, or int8 with the
// page scales `sc`) with the chunks' K/V already written; tables [C, max_pages], q_lens [C], ctx_lens [C] (int64,
// ctx = cached prefix + chunk). Returns [T, nh, hd]. Head sizes 64 and 128, query groups of 1, 2, 3, 4, 6 or 8.
static torch::Tensor prefill_common(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, const KvScales& sc,
                                    torch::Tensor tables, torch::Tensor q_lens, torch::Tensor ctx_lens, int64_t bs,
                                    double scale) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "paged_prefill: contiguous inputs");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && q_lens.dtype() == torch::kInt64 && ctx_lens.dtype() == torch::kInt64,
              "paged_prefill: int64 tables and lengths");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && (kc.scalar_type() == q.scalar_type() ||
              (kc.scalar_type() == torch::kChar && sc.k != nullptr)), "paged_prefill: caches in q's dtype or int8");
  const int64_t nh = q.size(1), hd = q.size(2), kvh = kc.size(0);
  auto t = tables.contiguous();
  auto ql = q_lens.contiguous();
  auto cl = ctx_lens.contiguous();
  std::vector<prefill::Chunk> chunks;
  int64_t row = 0;
  for (int64_t i = 0; i < ql.size(0); ++i) {
    const int64_t n = ql.data_ptr<int64_t>()[i], ctx = cl.data_ptr<int64_t>()[i];
    TORCH_CHECK(n >= 1 && ctx >= n && ctx <= t.size(1) * bs, "paged_prefill: bad chunk lengths");
    chunks.push_back({row, n, ctx, t.data_ptr<int64_t>() + i * t.size(1), nullptr});
    row += n;
  }
  TORCH_CHECK(row == q.size(0), "paged_prefill: q rows != sum of q_lens");
  auto out = torch::empty_like(q);
  bool ok = false;
#if defined(SY_PREFILL_I16)
  using Int8F32Path = prefill::I16DotPath;  // AVX2 without AVX-512: int16 products on int8 pages
#else
  using Int8F32Path = prefill::F32Path;
#endif
  if (q.scalar_type() == torch::kBFloat16) {
#if defined(__AVX512BF16__)
    using Bf16Path = prefill::Bf16DotPath;
    using Int8Bf16Path = Bf16Path;
#else
    using Bf16Path = prefill::F32Path;
    using Int8Bf16Path = Int8F32Path;
#endif
    ok = prefill::dispatch_cache<at::BFloat16, Bf16Path, Int8Bf16Path>(
        q.data_ptr<at::BFloat16>(), kc, vc, sc, out.data_ptr<at::BFloat16>(), chunks, nh, kvh, hd, bs,
        static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kFloat32) {
    ok = prefill::dispatch_cache<float, prefill::F32Path, Int8F32Path>(
        q.data_ptr<float>(), kc, vc, sc, out.data_ptr<float>(), chunks, nh, kvh, hd, bs, static_cast<float>(scale));
  }
  TORCH_CHECK(ok, "paged_prefill: unsupported dtype, head size or query group");
  return out;
}

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                            torch::Tensor q_lens, torch::Tensor ctx_lens, int64_t bs, double scale) {
  return prefill_common(q, kc, vc, KvScales{}, tables, q_lens, ctx_lens, bs, scale);
}

// int8 caches (kv_int8.h): k_scale, v_scale [kvh, pages] fp32
torch::Tensor paged_prefill_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                                 torch::Tensor v_scale, torch::Tensor tables, torch::Tensor q_lens,
                                 torch::Tensor ctx_lens, int64_t bs, double scale) {
  TORCH_CHECK(kc.scalar_type() == torch::kChar, "paged_prefill_int8: int8 caches");
  return prefill_common(q, kc, vc, kv_scales(k_scale, v_scale, kc.size(0)), tables, q_lens, ctx_lens, bs, scale);
}
