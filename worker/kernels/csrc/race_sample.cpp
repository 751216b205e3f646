// Exponential-race sampling for CPU: argmax_i p_i / E_i, E_i = -log(u_i), u_i a hash of (seed, step, token),
// in one pass over the probabilities with no [rows, vocab] temporaries. The same draw as worker/sampler.py's
// torch path (`uniform_noise`), which stays the reference.
//
// Most tokens are skipped without a logarithm: -log(u) >= 1 - u, so p / (1 - u) bounds a token's race value
// from above, and a token whose bound is below the best value so far cannot win.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

static constexpr float kTwoPow24Inv = 5.9604644775390625e-08f;  // 2^-24
static constexpr int64_t kChunk = 4096;                         // tokens per parallel task
static constexpr int64_t kBlock = 256;                          // tokens per vectorized bound pass
static constexpr float kSlack = 1.001f;  // covers rounding in logf and the division: a skip is always exact

static inline float race_uniform(uint32_t base, uint32_t token) {
  uint32_t h = fmix32(base ^ (token * 0x27D4EB2Fu));
  h = fmix32(h + base);
  const float u = (static_cast<float>(h >> 8) + 0.5f) * kTwoPow24Inv;
  return std::min(u, 1.0f - kTwoPow24Inv);
}

static inline float race_value(float p, uint32_t base, int64_t token) {
  return p / -std::log(race_uniform(base, static_cast<uint32_t>(token)));
}

struct Best {
  float value;
  int64_t index;
  // torch.argmax keeps the first of equal maxima
  bool beaten_by(float v, int64_t i) const { return v > value || (v == value && i < index); }
};

static Best scan_chunk(const float* p, uint32_t base, int64_t begin, int64_t end, Best best) {
  float bound[kBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t n = std::min(kBlock, end - b0);
    #pragma omp simd
    for (int64_t k = 0; k < n; ++k)
      bound[k] = p[b0 + k] * kSlack / (1.0f - race_uniform(base, static_cast<uint32_t>(b0 + k)));
    for (int64_t k = 0; k < n; ++k) {
      if (!(bound[k] >= best.value)) continue;
      const float v = race_value(p[b0 + k], base, b0 + k);
      if (best.beaten_by(v, b0 + k)) best = {v, b0 + k};
    }
  }
  return best;
}

torch::Tensor race_sample(torch::Tensor probs, torch::Tensor seed, torch::Tensor step, torch::Tensor seed_hi) {
  // probs [n, V] float32; seed, step [n] int64 (seed: its low 32 bits); seed_hi [n] int64 or empty
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32, "probs: [n, V] float32");
  TORCH_CHECK(seed.scalar_type() == torch::kInt64 && step.scalar_type() == torch::kInt64, "int64 seed, step");
  auto pc = probs.contiguous();
  auto sd = seed.contiguous(), st = step.contiguous(), hi = seed_hi.contiguous();
  const int64_t n = pc.size(0), V = pc.size(1);
  const bool has_hi = hi.numel() > 0;
  auto out = torch::empty({n}, torch::kInt64);
  if (n == 0 || V == 0) return out.zero_();
  const float* P = pc.data_ptr<float>();
  std::vector<uint32_t> bases(n);
  std::vector<Best> first(n);
  for (int64_t r = 0; r < n; ++r) {
    uint32_t mixed = static_cast<uint32_t>(sd.data_ptr<int64_t>()[r]) * 0x9E3779B1u
                   + static_cast<uint32_t>(st.data_ptr<int64_t>()[r]) * 0x85EBCA77u + 0x165667B1u;
    if (has_hi) mixed += fmix32(static_cast<uint32_t>(hi.data_ptr<int64_t>()[r])) * 0x27D4EB2Fu;
    bases[r] = fmix32(mixed);
    const float* row = P + r * V;
    const int64_t j = std::max_element(row, row + V) - row;  // a strong first candidate: the likeliest token
    first[r] = {race_value(row[j], bases[r], j), j};
  }
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  std::vector<Best> found(n * chunks);
  at::parallel_for(0, n * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c = task % chunks;
      found[task] = scan_chunk(P + r * V, bases[r], c * kChunk, std::min(V, (c + 1) * kChunk), first[r]);
    }
  });
  auto* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    Best best = first[r];
    for (int64_t c = 0; c < chunks; ++c) {
      const Best& b = found[r * chunks + c];
      if (best.beaten_by(b.value, b.index)) best = b;
    }
    o[r] = best.index;
  }
  return out;
}
