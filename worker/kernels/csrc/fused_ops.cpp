// Fused elementwise ops of a decoder layer for CPU: each is one pass (and one torch call) where the eager
// path (worker/fused.py, EagerOps) makes three to ten. Math in fp32, rounded once to the tensor's dtype
// (`to_f` / `from_f`, bf16.h); RoPE's products are not contracted into FMAs, so in fp32 it matches the eager
// formula bit for bit.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

template <typename T>
static void rms_rows(T* x, const T* r, T* out, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* xi = x + i * n;
      if (r != nullptr) {  // residual add in the tensor's dtype, as `x + r` rounds
        const T* ri = r + i * n;
        #pragma omp simd
        for (int64_t d = 0; d < n; ++d) xi[d] = from_f<T>(to_f(xi[d]) + to_f(ri[d]));
      }
      float ss = 0.f;
      #pragma omp simd reduction(+:ss)
      for (int64_t d = 0; d < n; ++d) { const float v = to_f(xi[d]); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* oi = out + i * n;
      #pragma omp simd
      for (int64_t d = 0; d < n; ++d) oi[d] = from_f<T>(to_f(xi[d]) * inv * to_f(w[d]));
    }
  });
}

// out = rms_norm(x) * w; with `residual` defined, first x += residual in place (the layer's skip connection)
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "add_rms_norm: contiguous x and weight");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = torch::empty_like(x);
  auto r = residual.defined() && residual.numel() ? residual.contiguous() : torch::Tensor();
  if (x.scalar_type() == torch::kBFloat16) {
    rms_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), r.defined() ? r.data_ptr<at::BFloat16>() : nullptr,
                           out.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), rows, n, (float)eps);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "add_rms_norm: bfloat16 or float32");
    rms_rows<float>(x.data_ptr<float>(), r.defined() ? r.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                    w.data_ptr<float>(), rows, n, (float)eps);
  }
  return out;
}

template <typename T>
static void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gu + i * 2 * n;
      silu_mul_row<T>(g, g + n, out + i * n, n);
    }
  });
}

// gate_up [.., 2n] -> silu(gate) * up [.., n]
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.is_contiguous() && gu.size(-1) % 2 == 0, "silu_mul: contiguous [.., 2n]");
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / (2 * n);
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gu.options());
  if (gu.scalar_type() == torch::kBFloat16) {
    silu_mul_rows<at::BFloat16>(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n);
  } else {
    TORCH_CHECK(gu.scalar_type() == torch::kFloat32, "silu_mul: bfloat16 or float32");
    silu_mul_rows<float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  }
  return out;
}

template <typename T>
__attribute__((optimize("fp-contract=off"))) static void rope_rows(T* qkv, const int64_t* pos, const float* cos_t, const float* sin_t, int64_t T_, int64_t heads,
                      int64_t n_rot, int64_t hd) {
  const int64_t half = hd / 2;
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_t + pos[t] * half;
      const float* s = sin_t + pos[t] * half;
      for (int64_t h = 0; h < n_rot; ++h) {
        T* x = qkv + (t * heads + h) * hd;
        #pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = to_f(x[d]), x2 = to_f(x[d + half]);
          x[d] = from_f<T>(x1 * c[d] - x2 * s[d]);
          x[d + half] = from_f<T>(x2 * c[d] + x1 * s[d]);
        }
      }
    }
  });
}

// rotate-half RoPE, in place, on the first n_rot heads of qkv [T, heads, hd]; cos/sin tables [max_pos, hd/2] fp32
void rope_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_t, torch::Tensor sin_t, int64_t n_rot) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 3, "rope_: contiguous [T, heads, hd]");
  TORCH_CHECK(cos_t.scalar_type() == torch::kFloat32 && sin_t.scalar_type() == torch::kFloat32, "fp32 tables");
  auto pos = positions.contiguous();
  const int64_t T_ = qkv.size(0), heads = qkv.size(1), hd = qkv.size(2);
  if (qkv.scalar_type() == torch::kBFloat16) {
    rope_rows<at::BFloat16>(qkv.data_ptr<at::BFloat16>(), pos.data_ptr<int64_t>(), cos_t.data_ptr<float>(),
                            sin_t.data_ptr<float>(), T_, heads, n_rot, hd);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kFloat32, "rope_: bfloat16 or float32");
    rope_rows<float>(qkv.data_ptr<float>(), pos.data_ptr<int64_t>(), cos_t.data_ptr<float>(),
                     sin_t.data_ptr<float>(), T_, heads, n_rot, hd);
  }
}
