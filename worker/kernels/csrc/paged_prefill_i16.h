// Prefill attention over int8 pages by int16 products (`vpmaddwd`), for AVX2 CPUs without AVX-512 (AMD Zen 3),
// where the fp32 path's FMAs do half the multiply-adds per instruction. Included by paged_prefill.cpp after its
// shared helpers (kKeys, Chunk, Task, softmax_row, pack_pairs, pair_scales).
//
// A block packs K^T as int16 [HD/2][16 keys][2] and V as int16 [8 key pairs][HD][2] (the codes as they are), then
// 16 K and 16 V page scales. Each query row is rounded to 15 bits with its own scale (quantize_query), so q.k sums
// exactly in int32 and scores are those sums times the row's and the key's scales. P is folded with each key's V
// scale, rounded to steps of 2^-15 of its row's largest value, and multiplied against V in int32, flushed to fp32
// every kFlushPairs key pairs (at most 2 x 32767 x 127 per pair: up to 256 pairs stay below 2^31).
#pragma once
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SY_PREFILL_I16 1
#include <immintrin.h>

namespace prefill {

struct I16DotPath {
  static constexpr int64_t kBlockFloats = kKeys + 1;  // x HD: K and V in int16, then 16 K and 16 V scales
  static constexpr int64_t kFlushPairs = 64;  // key pairs per V chunk (16 KB at head size 64), below int32's bound
  static constexpr int64_t kTaskTiles = 4;    // a task is this many times the dispatch's Rows
  static constexpr int kMaxRows = 6;          // rows per register tile: 6 x 2 accumulators, 2 operands, 1 broadcast

  template <typename C, int64_t HD>
  static void pack(const C* kc, const C* vc, const KvScales& sc, const Chunk& c, int64_t h, int64_t slots,
                   int64_t bs, int64_t kb, float* block) {
    static_assert(std::is_same_v<C, int8_t>, "int16 products read int8 pages only");
    pack_pairs<int16_t, C, HD>(kc, vc, sc, c, h, slots, bs, kb, block, [](C x) { return int16_t{x}; });
  }

  // The register tile: R <= 6 rows x 2 int32 accumulators as named variables (GCC kept an array of them on the
  // stack, a store-to-load chain per product, as in w8a8_avx2's tiles), each row's update `+=` madd(a, b[r]).
#define SY_I16_TILE_DECL                                                                                   \
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,  \
          a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define SY_I16_ROW(r, x0, x1, bcast)                                                                       \
  if constexpr (R > r) {                                                                                   \
    const __m256i b = _mm256_set1_epi32(bcast);                                                            \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(x0, b));                                         \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(x1, b));                                         \
    __asm__("" : "+x"(a##r##0), "+x"(a##r##1));                                                            \
  }
#define SY_I16_ROWS(x0, x1, bcast_of)                                                                      \
  SY_I16_ROW(0, x0, x1, bcast_of(0)) SY_I16_ROW(1, x0, x1, bcast_of(1)) SY_I16_ROW(2, x0, x1, bcast_of(2))  \
  SY_I16_ROW(3, x0, x1, bcast_of(3)) SY_I16_ROW(4, x0, x1, bcast_of(4)) SY_I16_ROW(5, x0, x1, bcast_of(5))
#define SY_I16_TILE_ARRAY {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}}

  // int32 sums of R query rows (qp: int16 pairs [R][HD/2]) against one block's 16 keys, times each row's scale
  // (qscale) and each key's K scale -> s[r * stride ...]
  template <int64_t HD, int R>
  static inline void scores(const int32_t* qp, const float* qscale, const int16_t* kt, float* s, int64_t stride) {
    static_assert(R <= kMaxRows);
    SY_I16_TILE_DECL
    for (int64_t d2 = 0; d2 < HD / 2; ++d2) {
      const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + d2 * 2 * kKeys));
      const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + d2 * 2 * kKeys + 16));
#define SY_Q(r) qp[(r) * (HD / 2) + d2]
      SY_I16_ROWS(k0, k1, SY_Q)
#undef SY_Q
    }
    const __m256i acc[6][2] = SY_I16_TILE_ARRAY;
    const float* ks = pair_scales(kt, HD);
    const __m256 ks0 = _mm256_loadu_ps(ks), ks1 = _mm256_loadu_ps(ks + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qs = _mm256_set1_ps(qscale[r]);
      _mm256_storeu_ps(s + r * stride, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(ks0, qs)));
      _mm256_storeu_ps(s + r * stride + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(ks1, qs)));
    }
  }

  // o[r][d] (fp32) += P x V over key pairs [j0, j1) (at most kFlushPairs; P: int16 pairs [R][stride2]), every
  // 16 dims in turn: the pairs' V (16 KB at head size 64) stays in L1 across the dims and the task's row tiles
  template <int64_t HD, int R>
  static inline void weighted_sum(const int32_t* pp, int64_t stride2, const int16_t* const* vblocks, int64_t j0,
                                  int64_t j1, float* o) {
    static_assert(R <= kMaxRows);
    for (int64_t d0 = 0; d0 < HD; d0 += 16) {
      SY_I16_TILE_DECL
      for (int64_t j2 = j0; j2 < j1; ++j2) {
        const int16_t* vp = vblocks[j2 / (kKeys / 2)] + (j2 % (kKeys / 2)) * HD * 2 + d0 * 2;
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + 16));
#define SY_P(r) pp[(r) * stride2 + j2]
        SY_I16_ROWS(v0, v1, SY_P)
#undef SY_P
      }
      const __m256i acc[6][2] = SY_I16_TILE_ARRAY;
      for (int r = 0; r < R; ++r) {
        float* dst = o + r * HD + d0;
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_cvtepi32_ps(acc[r][0])));
        _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), _mm256_cvtepi32_ps(acc[r][1])));
      }
    }
  }
#undef SY_I16_TILE_DECL
#undef SY_I16_ROW
#undef SY_I16_ROWS
#undef SY_I16_TILE_ARRAY

  // A task is kTaskTiles x Rows query rows (tokens x query heads of one kv head); each key block and V chunk is
  // read from memory once for all of them and reused from cache by the R-row register tiles.
  template <typename T, int64_t HD, int Rows>
  static void attend(const T* q, T* out, const Chunk& c, const Task& t, int64_t nh, int64_t g, float scale,
                     const float* const* blocks, std::vector<float>& sbuf, std::vector<uint16_t>& pbuf,
                     std::vector<const float*>& vblocks) {
    constexpr int R = Rows <= kMaxRows ? Rows : Rows / 2;  // rows per register tile
    constexpr int RT = Rows * kTaskTiles;                   // rows per task
    static_assert(Rows % R == 0);
    alignas(32) int16_t q16[RT * HD];
    alignas(32) float of[RT * HD] = {}, qscale[RT], pscale[RT], inv[RT];
    const int64_t rows = t.ntok * g, past = c.ctx - c.q_len, tiles = (rows + R - 1) / R;
    const int64_t nk = past + t.tok0 + t.ntok;
    const int64_t nkb = (nk + kKeys - 1) / kKeys, stride = nkb * kKeys;
    if (static_cast<int64_t>(sbuf.size()) < (RT + 1) * stride) sbuf.resize((RT + 1) * stride);  // + V scales
    if (static_cast<int64_t>(pbuf.size()) < RT * stride) pbuf.resize(RT * stride);
    float* s = sbuf.data();
    for (int64_t r = 0; r < tiles * R; ++r) {
      if (r >= rows) { std::fill(q16 + r * HD, q16 + (r + 1) * HD, int16_t{0}); qscale[r] = 0.f; continue; }
      const T* src = q + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
      qscale[r] = quantize_query(src, scale, 32767.f, q16 + r * HD, HD);
    }
    const int32_t* qp = reinterpret_cast<const int32_t*>(q16);
    vblocks.resize(nkb);
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int16_t* kt = reinterpret_cast<const int16_t*>(blocks[kb]);
      vblocks[kb] = reinterpret_cast<const float*>(kt + kKeys * HD);
      for (int64_t r0 = 0; r0 < tiles * R; r0 += R)
        scores<HD, R>(qp + r0 * (HD / 2), qscale + r0, kt, s + r0 * stride + kb * kKeys, stride);
    }
    float* sv = s + RT * stride;  // each key's V scale, folded into its probability before rounding
    for (int64_t kb = 0; kb < nkb; ++kb) std::memcpy(sv + kb * kKeys, pair_scales(blocks[kb], HD) + kKeys, kKeys * 4);
    int16_t* p16 = reinterpret_cast<int16_t*>(pbuf.data());
    for (int64_t r = 0; r < tiles * R; ++r) {
      float* sr = s + r * stride;
      inv[r] = r < rows ? softmax_row(sr, stride, past + t.tok0 + r / g + 1) : (std::fill(sr, sr + stride, 0.f), 0.f);
      pscale[r] = fold_and_round(sr, sv, stride, p16 + r * stride);
    }
    const int16_t* const* vb = reinterpret_cast<const int16_t* const*>(vblocks.data());
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t j0 = 0; j0 < pairs; j0 += kFlushPairs)
      for (int64_t r0 = 0; r0 < tiles * R; r0 += R)
        weighted_sum<HD, R>(reinterpret_cast<const int32_t*>(p16 + r0 * stride), stride / 2, vb, j0,
                            std::min(pairs, j0 + kFlushPairs), of + r0 * HD);
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
      const float f = pscale[r] * inv[r];
      #pragma omp simd
      for (int64_t d = 0; d < HD; ++d) dst[d] = from_f<T>(of[r * HD + d] * f);
    }
  }

  // p[j] = s[j] x sv[j] (left in s) in steps of 2^-15 of the row's largest (returned: what a step is worth; 0 for a
  // zero row); n is a multiple of 16
  static inline float fold_and_round(float* s, const float* sv, int64_t n, int16_t* p) {
    __m256 mv = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(sv + j));
      _mm256_storeu_ps(s + j, f);
      mv = _mm256_max_ps(mv, f);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    const float m = *std::max_element(lanes, lanes + 8);
    const __m256 k = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int64_t j = 0; j < n; j += 8) {  // values in [0, 32767]: the saturating packs leave them as they are
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + j), k));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j),
                       _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
    return m / 32767.f;
  }
};

}  // namespace prefill
#endif
