// Prefill attention by `vdpbf16ps` for bf16 models on CPUs with AVX512-BF16 (Intel Xeon from Sapphire Rapids,
// AMD Zen 4). Included by paged_prefill.cpp after its shared helpers (kKeys, Chunk, Task, softmax_row, pack_pairs,
// pair_scales).
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace prefill {

// bf16 models on CPUs with AVX512-BF16: both products by `vdpbf16ps` (pairs of bf16 into fp32 lanes, twice the
// fp32 FMA's work per instruction). K packs as [HD/2][16 keys][2] per block, V as [keys/2][HD][2]; q . k is exact
// in fp32 as with SDPA on bf16 inputs; P is rounded to bf16 for P.V, as SDPA does in bf16. int8 pages pack their
// codes as they are (integers up to 127 are exact in bf16) and each key's page scales beside them: the K scale
// multiplies the fp32 scores and the V scale the probabilities before their bf16 rounding, so the only rounding
// added to the model-dtype path's is the codes' own (K x scale rounded to bf16 had cost 0.3% perplexity).
struct Bf16DotPath {
  // x HD: K and V in bf16 take the floats of one fp32 copy; one more HD (>= 32 floats) holds 16 K, then 16 V scales
  static constexpr int64_t kBlockFloats = kKeys + 1;
  static constexpr int64_t kTaskTiles = 1;
  template <typename C, int64_t HD>
  static void pack(const C* kc, const C* vc, const KvScales& sc, const Chunk& c, int64_t h, int64_t slots,
                   int64_t bs, int64_t kb, float* block) {  // exact: bf16 values, or int8 codes
    pack_pairs<uint16_t, C, HD>(kc, vc, sc, c, h, slots, bs, kb, block,
                                [](C x) { return from_f<at::BFloat16>(to_f(x)).x; });
  }

  // scores of `Rows` rows against NB key blocks (s: the first block's; each next one 16 floats on). NB = 2 keeps
  // 2 x Rows independent accumulators in flight: with one block, Rows (6) dependent `vdpbf16ps` chains left the
  // dot units half idle
  template <int64_t HD, int Rows, int NB>
  static inline void scores(const uint32_t* qp, const uint16_t* const* ktb, float* s, int64_t stride, float scale) {
    __m512 acc[NB][Rows];
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < Rows; ++r) acc[b][r] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < HD / 2; ++d2) {
      __m512bh k[NB];
      for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(ktb[b] + d2 * 2 * kKeys);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(qp[r * (HD / 2) + d2]);
        for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], k[b], qv);
      }
    }
    for (int b = 0; b < NB; ++b) {  // the softmax scale times each key's K scale (1 on model-dtype pages)
      const __m512 vs = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_loadu_ps(pair_scales(ktb[b], HD)));
      for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(s + r * stride + b * kKeys, _mm512_mul_ps(acc[b][r], vs));
    }
  }

  template <int64_t HD, int Rows>
  static inline void weighted_sum(const uint32_t* pp, int64_t stride2, const uint16_t* const* vblocks, int64_t nk,
                                  float* o) {
    constexpr int64_t CV = Rows <= 6 ? 4 : 2;  // 16-dim accumulators per row: Rows x CV of 32 registers
    for (int64_t d0 = 0; d0 < HD; d0 += CV * 16) {
      __m512 acc[Rows][CV];
      for (int r = 0; r < Rows; ++r)
        for (int64_t c = 0; c < CV; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t j2 = 0; j2 < (nk + 1) / 2; ++j2) {
        __m512bh v[CV];
        const uint16_t* vp = vblocks[j2 / (kKeys / 2)] + (j2 % (kKeys / 2)) * HD * 2;
        for (int64_t c = 0; c < CV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + (d0 + c * 16) * 2);
        for (int r = 0; r < Rows; ++r) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[r * stride2 + j2]);
          for (int64_t c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pr);
        }
      }
      for (int r = 0; r < Rows; ++r)
        for (int64_t c = 0; c < CV; ++c) _mm512_storeu_ps(o + r * HD + d0 + c * 16, acc[r][c]);
    }
  }

  template <typename T, int64_t HD, int Rows>
  static void attend(const T* q, T* out, const Chunk& c, const Task& t, int64_t nh, int64_t g, float scale,
                     const float* const* blocks, std::vector<float>& sbuf, std::vector<uint16_t>& pbuf,
                     std::vector<const float*>& vblocks) {
    alignas(64) uint32_t qp[Rows * HD / 2];
    alignas(64) float of[Rows * HD], inv[Rows];
    const int64_t rows = t.ntok * g, past = c.ctx - c.q_len;
    const int64_t nk = past + t.tok0 + t.ntok;
    const int64_t nkb = (nk + kKeys - 1) / kKeys, stride = nkb * kKeys;
    if (static_cast<int64_t>(sbuf.size()) < (Rows + 1) * stride) sbuf.resize((Rows + 1) * stride);  // + V scales
    if (static_cast<int64_t>(pbuf.size()) < Rows * stride) pbuf.resize(Rows * stride);
    float* s = sbuf.data();
    for (int r = 0; r < Rows; ++r) {
      if (r >= rows) { std::fill(qp + r * HD / 2, qp + (r + 1) * HD / 2, 0u); continue; }
      const T* src = q + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
      std::memcpy(qp + r * HD / 2, src, HD * sizeof(uint16_t));
    }
    vblocks.resize(nkb);
    for (int64_t kb = 0; kb < nkb; ++kb)
      vblocks[kb] = reinterpret_cast<const float*>(reinterpret_cast<const uint16_t*>(blocks[kb]) + kKeys * HD);
    for (int64_t kb = 0; kb < nkb; kb += 2) {
      const uint16_t* kt[2] = {reinterpret_cast<const uint16_t*>(blocks[kb]),
                               reinterpret_cast<const uint16_t*>(blocks[std::min(kb + 1, nkb - 1)])};
      if (kb + 2 <= nkb) scores<HD, Rows, 2>(qp, kt, s + kb * kKeys, stride, scale);
      else scores<HD, Rows, 1>(qp, kt, s + kb * kKeys, stride, scale);
    }
    uint16_t* p16 = pbuf.data();
    float* sv = sbuf.data() + Rows * stride;  // each key's V scale, folded into its probability before rounding
    for (int64_t kb = 0; kb < nkb; ++kb) std::memcpy(sv + kb * kKeys, pair_scales(blocks[kb], HD) + kKeys, kKeys * 4);
    for (int r = 0; r < Rows; ++r) {
      float* sr = s + r * stride;
      inv[r] = r < rows ? softmax_row(sr, stride, past + t.tok0 + r / g + 1) : (std::fill(sr, sr + stride, 0.f), 0.f);
      uint16_t* pr = p16 + r * stride;
      #pragma omp simd
      for (int64_t j = 0; j < stride; ++j) pr[j] = from_f<at::BFloat16>(sr[j] * sv[j]).x;
    }
    weighted_sum<HD, Rows>(reinterpret_cast<const uint32_t*>(p16), stride / 2,
                           reinterpret_cast<const uint16_t* const*>(vblocks.data()), nk, of);
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
      #pragma omp simd
      for (int64_t d = 0; d < HD; ++d) dst[d] = from_f<T>(of[r * HD + d] * inv[r]);
    }
  }
};

}  // namespace prefill
#endif
