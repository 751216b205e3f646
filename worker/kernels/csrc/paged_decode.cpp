// Paged decode attention for CPU: K/V read straight from the pages, one (unit of sequences, kv head) per task;
// sequences whose tables share leading pages (a cached prefix) form a unit that reads those pages once.
//
// Head size and query group size are template constants for the common shapes (loops fully unrolled and
// vectorized: 2x faster than with runtime sizes); other shapes take the same code with runtime sizes.
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static constexpr int64_t kMaxHead = 256;
static constexpr int64_t kMaxGroupFloats = 4096;  // query group x head size

template <typename T>
static inline void row_to_float(const T* src, float* dst, int64_t n) {
  #pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
}

#if defined(__AVX512BF16__)
// The 16 sums of 16 vectors, in order: pairs within 128-bit lanes, then quads, then across lanes (45 ops where
// 16 separate reductions take ~130).
static inline __m512 sum16(__m512 v[16]) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// scores of g query heads (q: g rows of HD bf16) against n <= 16 consecutive key rows (bf16) by vdpbf16ps:
// products of bf16 pairs summed in fp32, one 16-lane partial per key, then sum16; out[j * L + i] = scale * q_j.k_i
template <int64_t HD>
static inline void scores16_bf16(const at::BFloat16* q, int64_t g, const at::BFloat16* k, int64_t n, float* out,
                                 int64_t L, float scale) {
  constexpr int64_t C = HD / 32;  // 32 bf16 per register
  alignas(64) at::BFloat16 part[16 * HD];
  k = key_block(k, n, 16, HD, part);
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t j = 0; j < g; ++j) {  // 16 keys unconditionally: the accumulators stay in registers
    __m512bh qv[C];
    for (int64_t c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + j * HD + c * 32);
    __m512 acc[16];
    for (int64_t i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(k + i * HD + c * 32), qv[c]);
    }
    _mm512_mask_storeu_ps(out + j * L, keep, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
  }
}
#endif

#if defined(__AVX2__)
// int8 pages without the AVX-512 kernel (paged_decode_int8.cpp), i.e. on AVX2-only CPUs: the 8 lane sums of 8 int32
// vectors, in order
static inline __m256i sum8_epi32(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// scores of G int16 query rows (q16 [G][HD]; each row's scale times the page's K scale in ps[j]) against n <= 8
// int8 key rows, K widened to int16 in registers for `vpmaddwd`: out[j * L + i] = ps[j] * (q16_j . k_i). Eight
// keys unconditionally (a page's last rows are copied with zeros after them), one transpose-sum per 8 scores
// where the fp32 loop reduced every score on its own.
template <int64_t HD, int64_t G>
static inline void scores8_int8(const int16_t* q16, const float* ps, const int8_t* k, int64_t n, float* out,
                                int64_t L) {
  alignas(32) int8_t part[8 * HD];
  k = key_block(k, n, 8, HD, part);
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t j = 0; j < G; ++j) {
    __m256i acc[8];
    for (int64_t i = 0; i < 8; ++i) {
      __m256i a = _mm256_setzero_si256();
      for (int64_t c = 0; c < HD / 16; ++c)
        a = _mm256_add_epi32(a, _mm256_madd_epi16(
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i * HD + c * 16))),
                                    _mm256_load_si256(reinterpret_cast<const __m256i*>(q16 + j * HD + c * 16))));
      acc[i] = a;
    }
    _mm256_maskstore_ps(out + j * L, live, _mm256_mul_ps(_mm256_cvtepi32_ps(sum8_epi32(acc)), _mm256_set1_ps(ps[j])));
  }
}
#endif

struct Shape {
  int64_t B, nh, kvh, slots, max_pages, bs;
  float scale;
  int64_t q_stride;  // elements between two sequences' query rows (nh * hd when q is contiguous)
};

// Longest-first assignment of the units * kvh tasks (load_of[u]: unit u's cost per kv head) to `threads` buckets of
// about equal total cost; `order` lists the tasks bucket by bucket, bucket c being order[bounds[c] .. bounds[c + 1]).
static void balance_loads(const int64_t* load_of, int64_t units, int64_t kvh, int64_t threads,
                          std::vector<int64_t>& order, std::vector<int64_t>& bounds) {
  const int64_t n = units * kvh, nb = std::max<int64_t>(1, std::min(threads, n));
  std::vector<int64_t> tasks(n), load(nb, 0), owner(n);
  for (int64_t t = 0; t < n; ++t) tasks[t] = t;
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t a, int64_t b) { return load_of[a / kvh] > load_of[b / kvh]; });
  for (int64_t t : tasks) {
    const int64_t c = std::min_element(load.begin(), load.end()) - load.begin();
    owner[t] = c;
    load[c] += load_of[t / kvh];
  }
  bounds.assign(nb + 1, 0);
  for (int64_t t = 0; t < n; ++t) ++bounds[owner[t] + 1];
  for (int64_t c = 0; c < nb; ++c) bounds[c + 1] += bounds[c];
  order.resize(n);
  std::vector<int64_t> next(bounds.begin(), bounds.end() - 1);
  for (int64_t t = 0; t < n; ++t) order[next[owner[t]]++] = t;
}

// The B * kvh (sequence, kv head) tasks by context length (+ a fixed cost per task).
static void balance_tasks(const int64_t* lens, int64_t B, int64_t kvh, int64_t threads, std::vector<int64_t>& order,
                          std::vector<int64_t>& bounds) {
  std::vector<int64_t> w(B);
  for (int64_t b = 0; b < B; ++b) w[b] = lens[b] + 16;
  balance_loads(w.data(), B, kvh, threads, order, bounds);
}

// Sequences whose block tables begin with the same pages (a prefix the radix cache shares) are read as a unit: each
// shared page comes from memory once for all the unit's query rows (from L1 for every member after the first), then
// each member's own pages. A unit's members are members[first .. first + count); `shared` leading pages are common.
struct Unit {
  int64_t first, count, shared;
};

// Runs of sequences with the same full first page, their common full pages counted, split into parts of at most
// `max_members` and into enough parts that the (unit, kv head) tasks spread over the threads; a sequence that shares
// nothing is a unit of one.
static void make_units(const int64_t* tables, const int64_t* lens, const Shape& sh, int64_t threads,
                       int64_t max_members, std::vector<int64_t>& members, std::vector<Unit>& units) {
  const int64_t B = sh.B, bs = sh.bs, mp = sh.max_pages;
  members.resize(B);
  for (int64_t b = 0; b < B; ++b) members[b] = b;
  const auto key = [&](int64_t b) { return lens[b] > bs ? tables[b * mp] : -1 - b; };  // -1 - b: a key of its own
  std::stable_sort(members.begin(), members.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  units.clear();
  for (int64_t s = 0; s < B;) {
    int64_t e = s + 1;
    while (e < B && key(members[e]) == key(members[s])) ++e;
    int64_t shared = e - s > 1 ? lens[members[s]] / bs : 0;  // full pages only
    for (int64_t i = s + 1; i < e && shared > 0; ++i) {
      const int64_t* a = tables + members[s] * mp;
      const int64_t* c = tables + members[i] * mp;
      int64_t p = 0;
      const int64_t lim = std::min(shared, lens[members[i]] / bs);
      while (p < lim && a[p] == c[p]) ++p;
      shared = p;
    }
    const int64_t m = e - s;
    if (shared == 0) {
      for (int64_t i = s; i < e; ++i) units.push_back({i, 1, 0});
    } else {
      int64_t parts = (m + max_members - 1) / max_members;
      while (parts < m && (parts * sh.kvh) % threads != 0 && parts * sh.kvh < 4 * threads) ++parts;
      for (int64_t k = 0; k < parts; ++k) {
        const int64_t lo = s + m * k / parts, hi = s + m * (k + 1) / parts;
        units.push_back({lo, hi - lo, shared});
      }
    }
    s = e;
  }
}

// int8 pages take scores8_int8 for q . k where AVX2 is built and the shape is a template constant
template <typename C, int64_t HD, int64_t G>
#if defined(__AVX2__)
constexpr bool kInt8Dot = std::is_same_v<C, int8_t> && HD != 0 && HD % 16 == 0 && G != 0;
#else
constexpr bool kInt8Dot = false;
#endif

// HD, G: head size and query heads per kv head, or 0 to read them from `hd_rt`, `g_rt`; C: the cache's element
// type, T or int8_t (kv_int8.h: scores and probabilities times the page's K and V scales). One task is a unit of
// sequences (make_units) and a kv head; each member's rows see its pages in order, so every output row is the one
// a task of its own would give.
template <typename T, typename C, int64_t HD, int64_t G>
static void decode_impl(const T* q, const C* kc, const C* vc, const KvScales sc, const int64_t* tables,
                        const int64_t* lens, T* out, const Shape sh, int64_t hd_rt, int64_t g_rt) {
  const int64_t hd = HD ? HD : hd_rt, g = G ? G : g_rt;
  const int64_t nh = sh.nh, kvh = sh.kvh, bs = sh.bs, mp = sh.max_pages, threads = at::get_num_threads();
  std::vector<int64_t> members, order, bounds;
  std::vector<Unit> units;
  make_units(tables, lens, sh, threads, std::max<int64_t>(1, kMaxGroupFloats / (g * hd)), members, units);
  std::vector<int64_t> load(units.size());
  for (size_t u = 0; u < units.size(); ++u) {  // a shared page is read once, its scores computed per member
    const Unit& x = units[u];
    load[u] = 16 * x.count + x.shared * bs;
    for (int64_t i = 0; i < x.count; ++i) load[u] += lens[members[x.first + i]] - x.shared * bs;
  }
  balance_loads(load.data(), static_cast<int64_t>(units.size()), kvh, threads, order, bounds);
  const int64_t buckets = static_cast<int64_t>(bounds.size()) - 1;
  at::parallel_for(0, buckets, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float qf[kMaxGroupFloats], acc[kMaxGroupFloats], row[kMaxHead];
    // the int8-page q . k path's queries and their scales, a row each
    alignas(64) int16_t q16[kInt8Dot<C, HD, G> ? kMaxGroupFloats : 1];
    float qscale[kInt8Dot<C, HD, G> ? kMaxGroupFloats / (HD > 0 ? HD : 1) : 1];
    std::vector<float> scores, denom;
    for (int64_t ti = bounds[c0]; ti < bounds[c1]; ++ti) {
      const int64_t task = order[ti];
      const Unit u = units[task / kvh];
      const int64_t h = task % kvh, m = u.count, rows = m * g, S = u.shared;
      const int64_t* mem = members.data() + u.first;
      int64_t Lmax = 0;
      for (int64_t i = 0; i < m; ++i) Lmax = std::max(Lmax, lens[mem[i]]);
      if (static_cast<int64_t>(scores.size()) < rows * Lmax) scores.resize(rows * Lmax);
      if (static_cast<int64_t>(denom.size()) < rows) denom.resize(rows);
      for (int64_t i = 0; i < m; ++i) row_to_float(q + mem[i] * sh.q_stride + h * g * hd, qf + i * g * hd, g * hd);
      for (int64_t i = 0; i < rows * hd; ++i) qf[i] *= sh.scale;
      if constexpr (kInt8Dot<C, HD, G>)  // each query row as int16 with its own scale (2^-15 of its largest element)
        for (int64_t r = 0; r < rows; ++r) qscale[r] = quantize_query(qf + r * HD, 1.f, 32767.f, q16 + r * HD, HD);
      const C* kbase = kc + h * sh.slots * hd;
      const C* vbase = vc + h * sh.slots * hd;
      // scores of member i's g rows against page p of its table (row stride Lmax)
      const auto score_page = [&](int64_t i, int64_t p) {
        const int64_t b = mem[i];
        const int64_t* table = tables + b * mp;
        const C* kp = kbase + table[p] * bs * hd;
        const int64_t n = std::min(bs, lens[b] - p * bs);
        const float sk = page_scale(sc.k, sc.pages, h, table[p]);
        float* srow = scores.data() + i * g * Lmax + p * bs;
#if defined(__AVX2__)
        if constexpr (kInt8Dot<C, HD, G>) {
          float ps[G];
          for (int64_t j = 0; j < G; ++j) ps[j] = qscale[i * G + j] * sk;
          for (int64_t i0 = 0; i0 < n; i0 += 8)
            scores8_int8<HD, G>(q16 + i * G * HD, ps, kp + i0 * hd, std::min<int64_t>(8, n - i0), srow + i0, Lmax);
          return;
        }
#endif
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<C, at::BFloat16> && HD != 0 && HD % 32 == 0) {
          for (int64_t i0 = 0; i0 < n; i0 += 16)
            scores16_bf16<HD>(q + b * sh.q_stride + h * g * hd, g, kp + i0 * hd, std::min<int64_t>(16, n - i0),
                              srow + i0, Lmax, sh.scale);
          return;
        }
#endif
        for (int64_t r = 0; r < n; ++r) {
          row_to_float(kp + r * hd, row, hd);
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qf + (i * g + j) * hd;
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int64_t d = 0; d < hd; ++d) s += qj[d] * row[d];
            srow[j * Lmax + r] = s * sk;
          }
        }
      };
      // acc of members [i0, i1) += p x V over page p of member i0's table (the same page for all of them)
      const auto add_page = [&](int64_t i0, int64_t i1, int64_t p) {
        const int64_t* table = tables + mem[i0] * mp;
        const C* vp = vbase + table[p] * bs * hd;
        const int64_t n = std::min(bs, lens[mem[i0]] - p * bs);
        const float sv = page_scale(sc.v, sc.pages, h, table[p]);
        for (int64_t r = 0; r < n; ++r) {
          row_to_float(vp + r * hd, row, hd);
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t j = 0; j < g; ++j) {
              const float pr = scores[(i * g + j) * Lmax + p * bs + r] * sv;
              float* aj = acc + (i * g + j) * hd;
              #pragma omp simd
              for (int64_t d = 0; d < hd; ++d) aj[d] += pr * row[d];
            }
        }
      };
      // every dtype: 1-4 KB pages scattered over the cache defeat the hardware prefetcher
      const auto prefetch = [&](const C* base, int64_t i, int64_t p, int64_t end) {
        if (p + kKvPrefetch < end) prefetch_bytes(base + tables[mem[i] * mp + p + kKvPrefetch] * bs * hd, bs * hd * sizeof(C));
      };
      for (int64_t p = 0; p < S; ++p) {  // scores = q . k: the shared pages once, then each member's own
        prefetch(kbase, 0, p, S);
        for (int64_t i = 0; i < m; ++i) score_page(i, p);
      }
      for (int64_t i = 0; i < m; ++i) {
        const int64_t npages = (lens[mem[i]] + bs - 1) / bs;
        for (int64_t p = S; p < npages; ++p) {
          prefetch(kbase, i, p, npages);
          score_page(i, p);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * Lmax;
        const int64_t L = lens[mem[r / g]];
        denom[r] = exp_row(sr, L, row_max(sr, L));
      }
      std::fill(acc, acc + rows * hd, 0.f);
      for (int64_t p = 0; p < S; ++p) {  // acc = sum of p * v, in the same page order
        prefetch(vbase, 0, p, S);
        add_page(0, m, p);
      }
      for (int64_t i = 0; i < m; ++i) {
        const int64_t npages = (lens[mem[i]] + bs - 1) / bs;
        for (int64_t p = S; p < npages; ++p) {
          prefetch(vbase, i, p, npages);
          add_page(i, i + 1, p);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = mem[r / g], j = r % g;
        for (int64_t d = 0; d < hd; ++d) out[(b * nh + h * g + j) * hd + d] = static_cast<T>(acc[r * hd + d] / denom[r]);
      }
    }
  });
}

template <typename T, typename C>
static void decode_dispatch(const T* q, const C* kc, const C* vc, const KvScales sc, const int64_t* tables,
                            const int64_t* lens, T* out, const Shape sh, int64_t hd, int64_t g) {
#define SY_DECODE_CASE(H, GG) \
  if (hd == H && g == GG) return decode_impl<T, C, H, GG>(q, kc, vc, sc, tables, lens, out, sh, hd, g);
  SY_DECODE_CASE(64, 1) SY_DECODE_CASE(64, 2) SY_DECODE_CASE(64, 3) SY_DECODE_CASE(64, 4) SY_DECODE_CASE(64, 8)
  SY_DECODE_CASE(128, 1) SY_DECODE_CASE(128, 2) SY_DECODE_CASE(128, 4) SY_DECODE_CASE(128, 8)
#undef SY_DECODE_CASE
  decode_impl<T, C, 0, 0>(q, kc, vc, sc, tables, lens, out, sh, hd, g);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor lens, int64_t bs, double scale) {
  // q [B, nh, hd] (heads contiguous; rows may be strided, e.g. the q part of a fused QKV output);
  // kc, vc [kvh, slots, hd]; tables [B, max_pages] int64; lens [B] int64 -> [B, nh, hd] contiguous
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && kc.is_contiguous() &&
              vc.is_contiguous(), "paged_decode: q rows of contiguous heads, contiguous caches");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "int64 tables and lens");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kc.size(0), slots = kc.size(1);
  auto out = torch::empty({B, nh, hd}, q.options());
  const int64_t g = nh / kvh;
  TORCH_CHECK(hd <= kMaxHead && g * hd <= kMaxGroupFloats, "paged_decode: head size or group too large");
  auto t = tables.contiguous();
  auto l = lens.contiguous();
  const Shape sh{B, nh, kvh, slots, t.size(1), bs, static_cast<float>(scale), q.stride(0)};
  if (q.scalar_type() == torch::kBFloat16) {
    decode_dispatch<at::BFloat16, at::BFloat16>(q.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(),
                                                vc.data_ptr<at::BFloat16>(), KvScales{}, t.data_ptr<int64_t>(),
                                                l.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), sh, hd, g);
  } else if (q.scalar_type() == torch::kFloat32) {
    decode_dispatch<float, float>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), KvScales{},
                                  t.data_ptr<int64_t>(), l.data_ptr<int64_t>(), out.data_ptr<float>(), sh, hd, g);
  } else {
    TORCH_CHECK(false, "paged_decode supports bfloat16 and float32");
  }
  return out;
}

// The step's new K/V rows into the paged caches in one call (two index_copy_ calls and their transposes before):
// k, v [T, kvh, hd] with contiguous heads (rows may be strided: views into the fused QKV output);
// kc, vc [kvh, slots, hd] contiguous; slot_mapping [T] int64.
void paged_kv_write(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 3 && kc.sizes() == vc.sizes() &&
              k.size(1) == kc.size(0) && k.size(2) == kc.size(2), "paged_kv_write: k, v [T, kvh, hd]; caches [kvh, slots, hd]");
  TORCH_CHECK(k.scalar_type() == kc.scalar_type() && v.scalar_type() == kc.scalar_type() &&
              vc.scalar_type() == kc.scalar_type(), "paged_kv_write: one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2) &&
              kc.is_contiguous() && vc.is_contiguous(), "paged_kv_write: contiguous heads and caches");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == k.size(0) &&
              slot_mapping.is_contiguous(), "paged_kv_write: int64 slot_mapping [T]");
  const int64_t T = k.size(0), kvh = k.size(1), slots = kc.size(1), es = k.element_size();
  const int64_t row = k.size(2) * es, ks = k.stride(0) * es, vs = v.stride(0) * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kcp = static_cast<char*>(kc.data_ptr());
  char* vcp = static_cast<char*>(vc.data_ptr());
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sm[t];
    TORCH_CHECK(slot >= 0 && slot < slots, "paged_kv_write: slot out of range");
    for (int64_t h = 0; h < kvh; ++h) {
      std::memcpy(kcp + (h * slots + slot) * row, kp + t * ks + h * row, row);
      std::memcpy(vcp + (h * slots + slot) * row, vp + t * vs + h * row, row);
    }
  }
}
