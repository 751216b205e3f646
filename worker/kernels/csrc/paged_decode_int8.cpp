// Paged decode attention over int8 KV pages (kv_int8.h), read in place: no page is dequantized into a temporary.
//
// With AVX-512 BW and head sizes 64 or 128 (query groups up to 8): the task's queries are rounded to 15-16 bits
// (one scale per query row, far below the pages' own 2^-8); q.k sums in int32, 16 keys at a time, times the page's
// K scale: with VNNI by `vpdpbusd` on the K bytes as they lie (scores16_vnni), else K widened to int16 for
// `vpmaddwd`. p x V: probabilities as int16 against V widened to int16, two rows per `vpdpwssd`/`vpmaddwd`, while
// the accumulators fit in registers, else V widened to fp32; each page's sums times its V scale. Elsewhere
// paged_decode.cpp's loops run over the int8 rows (scores x K scale, p x V scale). Both prefetch the page
// kKvPrefetch ahead (2-3x on scattered pages: 1-2 KB each defeat the hardware prefetcher).
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace dec8 {

#if defined(__AVX512BW__)
// lanes 4i..4i+3 = the sum of u[i]'s four 128-bit lanes
static inline __m512i sum_lanes4(const __m512i (&u)[4]) {
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, 0x88), _mm512_shuffle_i32x4(x01, x23, 0xDD));
}

// the 16 lane sums of 16 int32 vectors, in order (the int32 form of paged_decode.cpp's sum16)
static inline __m512i sum16_epi32(__m512i v[16]) {
  __m512i t[8], u[4];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
  return sum_lanes4(u);
}

static inline __m512i dot_step(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// out[j * L + i] = scale[j] * (q16_j . k_i) for n <= 16 int8 key rows of HD
template <int64_t HD>
static inline void scores16(const int16_t* q16, const float* qscale, int64_t g, const int8_t* k, int64_t n,
                            float* out, int64_t L) {
  constexpr int64_t C = HD / 32;  // 32 int16 per register
  for (int64_t j = 0; j < g; ++j) {
    __m512i qv[C], acc[16];
    for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(q16 + j * HD + c * 32);
    for (int64_t i = 0; i < 16; ++i) {  // keys past n stay zero (their rows may lie outside the page)
      acc[i] = _mm512_setzero_si512();
      if (i < n)
        for (int64_t c = 0; c < C; ++c)
          acc[i] = dot_step(acc[i], _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(k + i * HD + c * 32))), qv[c]);
    }
    alignas(64) float res[16];
    _mm512_store_ps(res, _mm512_mul_ps(_mm512_cvtepi32_ps(sum16_epi32(acc)), _mm512_set1_ps(qscale[j])));
    for (int64_t i = 0; i < n; ++i) out[j * L + i] = res[i];
  }
}

#if defined(__AVX512VNNI__)
// The same scores by `vpdpbusd` (unsigned x signed bytes, four per int32 lane) on the int8 K rows as they lie: each
// query is rounded to 15 bits (2^-15 of its row's largest) and split into two signed bytes, v = 256 hi + lo; a
// key row read as k + 128 (xor 0x80) meets hi, the sum is shifted by 8 and meets lo, and 128 x the query's sum
// comes off every score. A partial page is copied with zeros after it (16 keys per call unconditionally).
template <int64_t HD>
struct SplitQuery {  // one query as the scores16_vnni kernels read it (split_q15)
  alignas(64) int8_t q8[2 * HD];                 // hi bytes, then lo bytes
  alignas(64) int8_t spread[2][HD == 64 ? 4 : 1][64];  // head size 64 only: [hi, lo][o], lane l = 4 x dword 4l + o
  int32_t corr;                                  // 128 x the 15-bit codes' sum
};

// q row `src` times `mul` rounded to 15 bits with its own scale (returned; 0 for a zero row), split and spread
template <typename T, int64_t HD>
static inline float split_q15(const T* src, float mul, SplitQuery<HD>& q) {
  int32_t v[HD];
  const float scale = quantize_query(src, mul, 16383.f, v, HD);
  int32_t sum = 0;
  for (int64_t d = 0; d < HD; ++d) {
    const int32_t hi = (v[d] + 128) >> 8;  // |v| <= 16383: hi in [-64, 64], lo in [-128, 127]
    q.q8[d] = static_cast<int8_t>(hi);
    q.q8[HD + d] = static_cast<int8_t>(v[d] - hi * 256);
    sum += v[d];
  }
  q.corr = 128 * sum;
  if constexpr (HD == 64)  // only scores16_vnni64 reads the spread form
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t o = 0; o < 4; ++o) {
        const __m512i idx = _mm512_set_epi32(12 + o, 12 + o, 12 + o, 12 + o, 8 + o, 8 + o, 8 + o, 8 + o, 4 + o,
                                             4 + o, 4 + o, 4 + o, o, o, o, o);
        _mm512_store_si512(q.spread[half][o], _mm512_permutexvar_epi32(idx, _mm512_load_si512(q.q8 + half * HD)));
      }
  return scale;
}

// Head size 64: the 16 keys are half-transposed once for all G queries by two unpack stages (S[r][o] holds, in
// 128-bit lane l, dword 4l + o of keys 4r..4r+3); each query meets them with its dwords spread to match, and one
// cross-lane sum per 16 keys finishes its scores (0.88-0.91x the per-key sums' time in cache on Zen 4, same bits).
template <int64_t G>
static inline void scores16_vnni64(const SplitQuery<64>* qs, const float* qscale, const int8_t* k, int64_t n,
                                   float* out, int64_t L) {
  alignas(64) int8_t part[16 * 64];
  k = key_block(k, n, 16, 64, part);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i S[4][4];
  for (int64_t r = 0; r < 4; ++r) {
    __m512i x[4];
    for (int64_t m = 0; m < 4; ++m) x[m] = _mm512_xor_si512(_mm512_loadu_si512(k + (4 * r + m) * 64), flip);
    const __m512i a0 = _mm512_unpacklo_epi32(x[0], x[1]), a1 = _mm512_unpacklo_epi32(x[2], x[3]);
    const __m512i b0 = _mm512_unpackhi_epi32(x[0], x[1]), b1 = _mm512_unpackhi_epi32(x[2], x[3]);
    S[r][0] = _mm512_unpacklo_epi64(a0, a1);
    S[r][1] = _mm512_unpackhi_epi64(a0, a1);
    S[r][2] = _mm512_unpacklo_epi64(b0, b1);
    S[r][3] = _mm512_unpackhi_epi64(b0, b1);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t j = 0; j < G; ++j) {
    __m512i acc[4];
    for (int64_t r = 0; r < 4; ++r) {  // lane l, dword m: key 4r + m over dwords 4l..4l+3
      __m512i a = _mm512_setzero_si512();
      for (int64_t o = 0; o < 4; ++o) a = _mm512_dpbusd_epi32(a, S[r][o], _mm512_load_si512(qs[j].spread[0][o]));
      a = _mm512_slli_epi32(a, 8);
      for (int64_t o = 0; o < 4; ++o) a = _mm512_dpbusd_epi32(a, S[r][o], _mm512_load_si512(qs[j].spread[1][o]));
      acc[r] = a;
    }
    const __m512i dots = _mm512_sub_epi32(sum_lanes4(acc), _mm512_set1_epi32(qs[j].corr));
    _mm512_mask_storeu_ps(out + j * L, keep, _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(qscale[j])));
  }
}

// Other head sizes: key by key, then sum16_epi32 (transposing 128-dim keys would not fit the registers)
template <int64_t HD>
static inline void scores16_vnni_rows(const SplitQuery<HD>* qs, const float* qscale, int64_t g, const int8_t* k,
                                      int64_t n, float* out, int64_t L) {
  constexpr int64_t C = HD / 64;  // 64 bytes per register
  alignas(64) int8_t part[16 * HD];
  k = key_block(k, n, 16, HD, part);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t j = 0; j < g; ++j) {  // 16 keys unconditionally: the accumulators stay in registers
    __m512i qh[C], ql[C], acc[16];
    for (int64_t c = 0; c < C; ++c) qh[c] = _mm512_load_si512(qs[j].q8 + c * 64);
    for (int64_t c = 0; c < C; ++c) ql[c] = _mm512_load_si512(qs[j].q8 + HD + c * 64);
    for (int64_t i = 0; i < 16; ++i) {
      __m512i ku[C], a = _mm512_setzero_si512();
      for (int64_t c = 0; c < C; ++c) ku[c] = _mm512_xor_si512(_mm512_loadu_si512(k + i * HD + c * 64), flip);
      for (int64_t c = 0; c < C; ++c) a = _mm512_dpbusd_epi32(a, ku[c], qh[c]);
      a = _mm512_slli_epi32(a, 8);
      for (int64_t c = 0; c < C; ++c) a = _mm512_dpbusd_epi32(a, ku[c], ql[c]);
      acc[i] = a;
    }
    const __m512i dots = _mm512_sub_epi32(sum16_epi32(acc), _mm512_set1_epi32(qs[j].corr));
    _mm512_mask_storeu_ps(out + j * L, keep, _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(qscale[j])));
  }
}

template <int64_t HD, int64_t G>
static inline void scores16_vnni(const SplitQuery<HD>* qs, const float* qscale, const int8_t* k, int64_t n,
                                 float* out, int64_t L) {
  if constexpr (HD == 64)
    scores16_vnni64<G>(qs, qscale, k, n, out, L);
  else
    scores16_vnni_rows<HD>(qs, qscale, G, k, n, out, L);
}
#endif

static inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// p x V in int16 x int16 -> int32 (`vpdpwssd`), two rows at a time. Probabilities (at most 1: the row max is taken
// out) are int16 steps of 2^-15 in `p16` ([G][Lpad], zero past L); rows i and i+1 are interleaved per dimension
// (unpacklo/hi within 128-bit lanes), so accumulator k of a row holds the dimensions `pv_dim` names. A page's int32
// sums (at most 16 x 2 x 32767 x 127 per page of 16) go into fp32 times its V scale.
constexpr float kP16 = 32767.f;

static inline int64_t pv_dim(int64_t k, int64_t e) {  // dimension of lane e of accumulator k
  return 32 * (k / 2) + (e / 4) * 8 + (k % 2) * 4 + e % 4;
}

template <int64_t HD, int64_t G>
static inline void pv_page(const int16_t* p16, int64_t Lpad, int64_t pos, const int8_t* vp, int64_t n, int64_t bs,
                           float sv, __m512 (&acc)[G][HD / 16]) {
  constexpr int64_t C = HD / 32, K = HD / 16;
  alignas(64) int8_t last[2 * HD];
  __m512i ai[G][K];
  for (int64_t j = 0; j < G; ++j)
    for (int64_t k = 0; k < K; ++k) ai[j][k] = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 2) {  // p past n is zero, so a stale row there adds nothing
    const int8_t* r = vp + i * HD;
    if (i + 1 == bs) {  // odd page sizes: the row past the page reads as zeros
      std::memcpy(last, r, HD);
      std::memset(last + HD, 0, HD);
      r = last;
    }
    __m512i lo[C], hi[C];
    for (int64_t c = 0; c < C; ++c) {
      const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + c * 32)));
      const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + HD + c * 32)));
      lo[c] = _mm512_unpacklo_epi16(a, b);
      hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t j = 0; j < G; ++j) {
      int32_t two;  // (p_i, p_i+1)
      std::memcpy(&two, p16 + j * Lpad + pos + i, sizeof(two));
      const __m512i pp = _mm512_set1_epi32(two);
      for (int64_t c = 0; c < C; ++c) {
        ai[j][2 * c] = dot_step(ai[j][2 * c], lo[c], pp);
        ai[j][2 * c + 1] = dot_step(ai[j][2 * c + 1], hi[c], pp);
      }
    }
  }
  const __m512 s = _mm512_set1_ps(sv / kP16);
  for (int64_t j = 0; j < G; ++j)
    for (int64_t k = 0; k < K; ++k) acc[j][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[j][k]), s, acc[j][k]);
}

// row j of `scores` ([G][L], softmax numerators) as int16 steps of 2^-15 into p16 ([G][Lpad], zeros past L)
template <int64_t G>
static inline void quantize_probs(const float* scores, int64_t L, int16_t* p16, int64_t Lpad) {
  const __m512 k = _mm512_set1_ps(kP16);
  for (int64_t j = 0; j < G; ++j) {
    int64_t i = 0;
    for (; i + 16 <= L; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + j * Lpad + i),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(scores + j * L + i), k))));
    for (; i < L; ++i) p16[j * Lpad + i] = static_cast<int16_t>(std::nearbyint(scores[j * L + i] * kP16));
    for (; i < Lpad; ++i) p16[j * Lpad + i] = 0;
  }
}

template <typename T, int64_t HD, int64_t G>
static void decode(const T* q, const int8_t* kc, const int8_t* vc, const KvScales sc, const int64_t* tables,
                   const int64_t* lens, T* out, const Shape sh) {
  constexpr int64_t V = HD / 16;  // fp32 registers per V row
  constexpr bool kPv16 = G * V <= 16;  // the int16 p x V path while its accumulators fit in registers
  const int64_t nh = sh.nh, kvh = sh.kvh, bs = sh.bs;
  std::vector<int64_t> order, bounds;
  balance_tasks(lens, sh.B, kvh, at::get_num_threads(), order, bounds);
  const int64_t buckets = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, buckets, 1, [&](int64_t c0, int64_t c1) {
#if defined(__AVX512VNNI__)
    SplitQuery<HD> qs[G];  // the split queries (scores16_vnni)
#else
    alignas(64) int16_t q16[G * HD];
#endif
    float qscale[G], denom[G];
    std::vector<float> scores;
    std::vector<int16_t> p16;
    for (int64_t ti = bounds[c0]; ti < bounds[c1]; ++ti) {
      const int64_t task = order[ti];
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t L = lens[b], npages = (L + bs - 1) / bs;
      if (static_cast<int64_t>(scores.size()) < G * L) scores.resize(G * L);
      for (int64_t j = 0; j < G; ++j) {  // q row j, times the softmax scale, split 15 bits (VNNI) or int16, own scale
        const T* src = q + b * sh.q_stride + (h * G + j) * HD;
#if defined(__AVX512VNNI__)
        qscale[j] = split_q15<T, HD>(src, sh.scale, qs[j]);
#else
        qscale[j] = quantize_query(src, sh.scale, 32767.f, q16 + j * HD, HD);
#endif
      }
      const int8_t* kbase = kc + h * sh.slots * HD;
      const int8_t* vbase = vc + h * sh.slots * HD;
      const int64_t* table = tables + b * sh.max_pages;
      for (int64_t p = 0; p < std::min(kKvPrefetch, npages); ++p) prefetch_bytes(kbase + table[p] * bs * HD, bs * HD);
      for (int64_t p = 0; p < npages; ++p) {
        const int8_t* kp = kbase + table[p] * bs * HD;
        const int64_t n = std::min(bs, L - p * bs);
        if (p + kKvPrefetch < npages) prefetch_bytes(kbase + table[p + kKvPrefetch] * bs * HD, bs * HD);
        float ps[G];
        const float sk = page_scale(sc.k, sc.pages, h, table[p]);
        for (int64_t j = 0; j < G; ++j) ps[j] = qscale[j] * sk;
        for (int64_t i0 = 0; i0 < n; i0 += 16)
#if defined(__AVX512VNNI__)
          scores16_vnni<HD, G>(qs, ps, kp + i0 * HD, std::min<int64_t>(16, n - i0), scores.data() + p * bs + i0, L);
#else
          scores16<HD>(q16, ps, G, kp + i0 * HD, std::min<int64_t>(16, n - i0), scores.data() + p * bs + i0, L);
#endif
      }
      for (int64_t p = 0; p < std::min(kKvPrefetch, npages); ++p) prefetch_bytes(vbase + table[p] * bs * HD, bs * HD);
      softmax_numerators(scores.data(), G, L, denom);
      __m512 acc[G][V];
      for (int64_t j = 0; j < G; ++j)
        for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_setzero_ps();
      if constexpr (kPv16) {  // int16 probabilities, two rows per vpdpwssd; acc in pv_dim's order
        const int64_t Lpad = npages * bs + 2;
        if (static_cast<int64_t>(p16.size()) < G * Lpad) p16.resize(G * Lpad);
        quantize_probs<G>(scores.data(), L, p16.data(), Lpad);
        for (int64_t p = 0; p < npages; ++p) {
          const int8_t* vp = vbase + table[p] * bs * HD;
          if (p + kKvPrefetch < npages) prefetch_bytes(vbase + table[p + kKvPrefetch] * bs * HD, bs * HD);
          pv_page<HD, G>(p16.data(), Lpad, p * bs, vp, std::min(bs, L - p * bs), bs,
                         page_scale(sc.v, sc.pages, h, table[p]), acc);
        }
        for (int64_t j = 0; j < G; ++j) {
          alignas(64) float o[HD];
          for (int64_t k = 0; k < V; ++k) {
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, acc[j][k]);
            for (int64_t e = 0; e < 16; ++e) o[pv_dim(k, e)] = lanes[e] / denom[j];
          }
          T* dst = out + (b * nh + h * G + j) * HD;
          for (int64_t d = 0; d < HD; ++d) dst[d] = from_f<T>(o[d]);
        }
        continue;
      }
      for (int64_t p = 0; p < npages; ++p) {  // acc += p x V scale x v, a row at a time
        const int8_t* vp = vbase + table[p] * bs * HD;
        const int64_t n = std::min(bs, L - p * bs);
        if (p + kKvPrefetch < npages) prefetch_bytes(vbase + table[p + kKvPrefetch] * bs * HD, bs * HD);
        const float sv = page_scale(sc.v, sc.pages, h, table[p]);
        const float* sp = scores.data() + p * bs;
        for (int64_t i = 0; i < n; ++i) {
          __m512 row[V];
          for (int64_t c = 0; c < V; ++c) row[c] = widen(vp + i * HD + c * 16);
          for (int64_t j = 0; j < G; ++j) {
            const __m512 pr = _mm512_set1_ps(sp[j * L + i] * sv);
            for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_fmadd_ps(pr, row[c], acc[j][c]);
          }
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        alignas(64) float o[HD];
        const __m512 inv = _mm512_set1_ps(1.f / denom[j]);
        for (int64_t c = 0; c < V; ++c) _mm512_store_ps(o + c * 16, _mm512_mul_ps(acc[j][c], inv));
        T* dst = out + (b * nh + h * G + j) * HD;
        for (int64_t d = 0; d < HD; ++d) dst[d] = from_f<T>(o[d]);
      }
    }
  });
}
#endif

// the fast path where it applies (true), else false: the caller runs paged_decode.cpp's loops
template <typename T>
static bool fast(const T* q, const int8_t* kc, const int8_t* vc, const KvScales sc, const int64_t* tables,
                 const int64_t* lens, T* out, const Shape sh, int64_t hd, int64_t g) {
#if defined(__AVX512BW__)
#define SY_DEC8_CASE(H, GG) \
  if (hd == H && g == GG) { decode<T, H, GG>(q, kc, vc, sc, tables, lens, out, sh); return true; }
  SY_DEC8_CASE(64, 1) SY_DEC8_CASE(64, 2) SY_DEC8_CASE(64, 3) SY_DEC8_CASE(64, 4) SY_DEC8_CASE(64, 8)
  SY_DEC8_CASE(128, 1) SY_DEC8_CASE(128, 2) SY_DEC8_CASE(128, 4) SY_DEC8_CASE(128, 8)
#undef SY_DEC8_CASE
#endif
  return false;
}

template <typename T>
static void run(const T* q, const int8_t* kc, const int8_t* vc, const KvScales sc, const int64_t* tables,
                const int64_t* lens, T* out, const Shape sh, int64_t hd, int64_t g) {
  if (!fast<T>(q, kc, vc, sc, tables, lens, out, sh, hd, g))
    decode_dispatch<T, int8_t>(q, kc, vc, sc, tables, lens, out, sh, hd, g);
}

}  // namespace dec8

// paged decode over int8 caches: q [B, nh, hd]; kc, vc [kvh, slots, hd] int8; k_scale, v_scale
// [kvh, pages] fp32; tables [B, max_pages], lens [B] int64 -> [B, nh, hd] in q's dtype
torch::Tensor paged_decode_int8(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor k_scale,
                                torch::Tensor v_scale, torch::Tensor tables, torch::Tensor lens, int64_t bs,
                                double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && kc.is_contiguous() &&
              vc.is_contiguous() && kc.scalar_type() == torch::kChar && vc.scalar_type() == torch::kChar,
              "paged_decode_int8: q rows of contiguous heads, contiguous int8 caches");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "int64 tables and lens");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kc.size(0), slots = kc.size(1);
  const KvScales sc = kv_scales(k_scale, v_scale, kvh);
  TORCH_CHECK(slots == sc.pages * bs, "paged_decode_int8: one scale per page");
  const int64_t g = nh / kvh;
  TORCH_CHECK(hd <= kMaxHead && g * hd <= kMaxGroupFloats, "paged_decode_int8: head size or group too large");
  auto out = torch::empty({B, nh, hd}, q.options());
  auto t = tables.contiguous();
  auto l = lens.contiguous();
  const Shape sh{B, nh, kvh, slots, t.size(1), bs, static_cast<float>(scale), q.stride(0)};
  const int8_t* k8 = kc.data_ptr<int8_t>();
  const int8_t* v8 = vc.data_ptr<int8_t>();
  if (q.scalar_type() == torch::kBFloat16)
    dec8::run<at::BFloat16>(q.data_ptr<at::BFloat16>(), k8, v8, sc, t.data_ptr<int64_t>(), l.data_ptr<int64_t>(),
                            out.data_ptr<at::BFloat16>(), sh, hd, g);
  else if (q.scalar_type() == torch::kFloat32)
    dec8::run<float>(q.data_ptr<float>(), k8, v8, sc, t.data_ptr<int64_t>(), l.data_ptr<int64_t>(),
                     out.data_ptr<float>(), sh, hd, g);
  else
    TORCH_CHECK(false, "paged_decode_int8 supports bfloat16 and float32");
  return out;
}
