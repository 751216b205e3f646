// Causal prefill attention for CPU over the paged KV cache: every prefill chunk of a step in one call, its
// queries against the cached prefix and the chunk itself (already written to the pages), scores in fp32.
//
// Two passes. Pack: per key block of 16 (a page, with 16-token pages: pages that chunks share through the prefix
// cache are packed once) and kv head, K is copied to fp32 transposed ([d][16]) and V to fp32 rows, so the
// products below read unit-stride vectors (bf16 models on AVX512-BF16: bf16 pairs for `vdpbf16ps`,
// paged_prefill_bf16.h). Attend: a task is up to `Rows` query rows (tokens x
// query heads of one kv head); scores for 16 keys at a time are `Rows` vector accumulators over the head size
// (broadcast q[r][d] times a row of K^T), then an exact softmax over the row and P.V in register tiles. Tasks
// run longest first from a shared counter, so the causal triangle's uneven tasks balance across threads.
// int8 pages on AVX2 CPUs without AVX-512 take int16 products instead (paged_prefill_i16.h).
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace prefill {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * 4)));
typedef float vec_u __attribute__((vector_size(kLanes * 4), aligned(4)));
constexpr int64_t kKeys = 16;                        // keys per packed block
constexpr int64_t kKeyVecs = kKeys / kLanes;         // vectors per 16 scores
constexpr int64_t kDimChunk = kLanes == 16 ? 64 : 16;  // head dims per P.V register tile
constexpr int64_t kChunkVecs = kDimChunk / kLanes;

static inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
static inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

struct Chunk {
  int64_t row0, q_len, ctx;  // first row in q, tokens, keys (past + q_len)
  const int64_t* table;
  const int64_t* packed;  // per key block: its index in the pack buffer (pages shared by chunks are packed once)
};

struct Task {
  int64_t chunk, head, tok0, ntok;  // kv head, first token of the chunk, tokens in this task
  int64_t cost;                     // keys read (for longest-first order)
};

// C: the cache's element type (the model's, or int8_t with the page scales of `sc`, kv_int8.h)
template <typename C, int64_t HD>
static void pack_f32(const C* kc, const C* vc, const KvScales& sc, const Chunk& c, int64_t h, int64_t slots,
                     int64_t bs, int64_t kb, float* block) {
  // key block kb: K^T as [d][16], then V rows as [16][d]; keys past ctx are zero (masked later)
  float* dst = block;
  for (int64_t i = 0; i < kKeys; ++i) {
    const int64_t key = kb * kKeys + i;
    float* vrow = block + kKeys * HD + i * HD;
    if (key >= c.ctx) {
      for (int64_t d = 0; d < HD; ++d) { dst[d * kKeys + i] = 0.f; vrow[d] = 0.f; }
      continue;
    }
    const int64_t page = c.table[key / bs], slot = page * bs + key % bs;
    const C* krow = kc + (h * slots + slot) * HD;
    const C* vsrc = vc + (h * slots + slot) * HD;
    const float sk = page_scale(sc.k, sc.pages, h, page), sv = page_scale(sc.v, sc.pages, h, page);
    for (int64_t d = 0; d < HD; ++d) dst[d * kKeys + i] = to_f(krow[d]) * sk;
    #pragma omp simd
    for (int64_t d = 0; d < HD; ++d) vrow[d] = to_f(vsrc[d]) * sv;
  }
}

// scores of `Rows` query rows (qf [Rows][HD], pre-scaled) against key block kb -> s[r * stride + kb * 16 ...]
template <int64_t HD, int Rows>
static inline void score_block(const float* qf, const float* ktb, float* s, int64_t stride) {
  vec acc[Rows][kKeyVecs] = {};
  for (int64_t d = 0; d < HD; ++d) {
    vec k[kKeyVecs];
    for (int64_t v = 0; v < kKeyVecs; ++v) k[v] = load(ktb + d * kKeys + v * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float qv = qf[r * HD + d];
      for (int64_t v = 0; v < kKeyVecs; ++v) acc[r][v] += qv * k[v];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int64_t v = 0; v < kKeyVecs; ++v) store(s + r * stride + v * kLanes, acc[r][v]);
}

// out rows [Rows][HD] (fp32) = P [Rows][nk] . V [nk][HD] (V rows of key j in block j / 16), one register tile
// of head dims at a time
template <int64_t HD, int Rows>
static inline void weighted_sum(const float* p, int64_t stride, const float* const* vblocks, int64_t nk, float* o) {
  for (int64_t d0 = 0; d0 < HD; d0 += kDimChunk) {
    vec acc[Rows][kChunkVecs] = {};
    for (int64_t j = 0; j < nk; ++j) {
      const float* vrow = vblocks[j / kKeys] + (j % kKeys) * HD;
      vec v[kChunkVecs];
      for (int64_t c = 0; c < kChunkVecs; ++c) v[c] = load(vrow + d0 + c * kLanes);
      for (int r = 0; r < Rows; ++r) {
        const float pr = p[r * stride + j];
        for (int64_t c = 0; c < kChunkVecs; ++c) acc[r][c] += pr * v[c];
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int64_t c = 0; c < kChunkVecs; ++c) store(o + r * HD + d0 + c * kLanes, acc[r][c]);
  }
}

// softmax of row s[0, n) in place (keys past `limit` masked out); returns 1 / sum
static inline float softmax_row(float* s, int64_t n, int64_t limit) {
  const float sum = exp_row(s, limit, row_max(s, limit));
  for (int64_t j = limit; j < n; ++j) s[j] = 0.f;
  return 1.f / sum;
}

template <typename T, int64_t HD, int Rows>
static void attend_f32(const T* q, T* out, const Chunk& c, const Task& t, int64_t nh, int64_t g, float scale,
                       const float* const* blocks, std::vector<float>& sbuf, std::vector<uint16_t>&,
                       std::vector<const float*>& vblocks) {
  alignas(64) float qf[Rows * HD], of[Rows * HD], inv[Rows];
  const int64_t rows = t.ntok * g, past = c.ctx - c.q_len;
  const int64_t nk = past + t.tok0 + t.ntok;  // keys the last token of the task sees
  const int64_t nkb = (nk + kKeys - 1) / kKeys, stride = nkb * kKeys;
  if (static_cast<int64_t>(sbuf.size()) < Rows * stride) sbuf.resize(Rows * stride);
  float* s = sbuf.data();
  for (int r = 0; r < Rows; ++r) {  // row r = token r / g, query head r % g of kv head t.head
    float* dst = qf + r * HD;
    if (r >= rows) { std::fill(dst, dst + HD, 0.f); continue; }
    const T* src = q + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
    #pragma omp simd
    for (int64_t d = 0; d < HD; ++d) dst[d] = to_f(src[d]) * scale;
  }
  vblocks.resize(nkb);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    score_block<HD, Rows>(qf, blocks[kb], s + kb * kKeys, stride);
    vblocks[kb] = blocks[kb] + kKeys * HD;
  }
  for (int r = 0; r < Rows; ++r)
    inv[r] = r < rows ? softmax_row(s + r * stride, stride, past + t.tok0 + r / g + 1)
                      : (std::fill(s + r * stride, s + (r + 1) * stride, 0.f), 0.f);
  weighted_sum<HD, Rows>(s, stride, vblocks.data(), nk, of);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((c.row0 + t.tok0 + r / g) * nh + t.head * g + r % g) * HD;
    #pragma omp simd
    for (int64_t d = 0; d < HD; ++d) dst[d] = from_f<T>(of[r * HD + d] * inv[r]);
  }
}

// fp32 products everywhere (any CPU, both dtypes). A packed block: K^T and V, 16 x HD floats each.
struct F32Path {
  static constexpr int64_t kBlockFloats = 2 * kKeys;  // x HD
  static constexpr int64_t kTaskTiles = 1;            // tokens per task: this many times Rows / g
  template <typename C, int64_t HD>
  static void pack(const C* kc, const C* vc, const KvScales& sc, const Chunk& c, int64_t h, int64_t slots,
                   int64_t bs, int64_t kb, float* block) {
    pack_f32<C, HD>(kc, vc, sc, c, h, slots, bs, kb, block);
  }
  template <typename T, int64_t HD, int Rows>
  static void attend(const T* q, T* out, const Chunk& c, const Task& t, int64_t nh, int64_t g, float scale,
                     const float* const* blocks, std::vector<float>& sbuf, std::vector<uint16_t>& pbuf,
                     std::vector<const float*>& vblocks) {
    attend_f32<T, HD, Rows>(q, out, c, t, nh, g, scale, blocks, sbuf, pbuf, vblocks);
  }
};

// the 16 K, then 16 V scales of a block packed by pack_pairs
static inline const float* pair_scales(const void* block, int64_t hd) {
  return reinterpret_cast<const float*>(block) + kKeys * hd;
}

// Key block kb for the pair-wise dot products (`vdpbf16ps`, `vpmaddwd`): K^T as [HD/2][16 keys][2] and V as
// [8 key pairs][HD][2] elements E (`elem` converts a cache element exactly), then 16 K and 16 V scales (1 for
// model-dtype pages); keys past ctx are zeros with scales 0 (masked later)
template <typename E, typename C, int64_t HD, typename Elem>
static void pack_pairs(const C* kc, const C* vc, const KvScales& sc, const Chunk& c, int64_t h, int64_t slots,
                       int64_t bs, int64_t kb, float* block, Elem elem) {
  E* kt = reinterpret_cast<E*>(block);
  E* vp = kt + kKeys * HD;
  float* scales = block + kKeys * HD;  // K scales [16], then V scales [16]
  for (int64_t i = 0; i < kKeys; ++i) {
    const int64_t key = kb * kKeys + i;
    E* vdst = vp + (i / 2) * HD * 2 + (i & 1);
    if (key >= c.ctx) {
      for (int64_t d = 0; d < HD; ++d) { kt[(d / 2) * 2 * kKeys + i * 2 + (d & 1)] = 0; vdst[d * 2] = 0; }
      scales[i] = scales[kKeys + i] = 0.f;
      continue;
    }
    const int64_t page = c.table[key / bs], slot = page * bs + key % bs;
    const C* krow = kc + (h * slots + slot) * HD;
    const C* vrow = vc + (h * slots + slot) * HD;
    scales[i] = page_scale(sc.k, sc.pages, h, page);
    scales[kKeys + i] = page_scale(sc.v, sc.pages, h, page);
    for (int64_t d = 0; d < HD; ++d) {
      kt[(d / 2) * 2 * kKeys + i * 2 + (d & 1)] = elem(krow[d]);
      vdst[d * 2] = elem(vrow[d]);
    }
  }
}

}  // namespace prefill

#include "paged_prefill_bf16.h"
#include "paged_prefill_i16.h"

namespace prefill {

template <typename T, typename C, int64_t HD, int Rows, typename Path>
static void run(const T* q, const C* kc, const C* vc, const KvScales& sc, T* out, std::vector<Chunk>& chunks,
                int64_t nh, int64_t kvh, int64_t slots, int64_t bs, float scale) {
  const int64_t g = nh / kvh, tok_per_task = std::max<int64_t>(1, Rows / g) * Path::kTaskTiles;
  // key blocks to pack: with 16-token pages a block is a page, and a page several chunks read (a shared cached
  // prefix) is packed once, by the chunk that sees most of it; otherwise one block per (chunk, block)
  std::vector<int64_t> packed_of;
  std::vector<std::pair<int64_t, int64_t>> owners;  // per packed block: (chunk, key block)
  std::unordered_map<int64_t, int64_t> by_page;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t nkb = (chunks[i].ctx + kKeys - 1) / kKeys;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      int64_t idx = static_cast<int64_t>(owners.size());
      if (bs == kKeys) {
        auto [it, fresh] = by_page.emplace(chunks[i].table[kb], idx);
        idx = it->second;
        if (!fresh) {  // keep the owner that sees the most keys of the page (zero-fills the fewest)
          const Chunk& o = chunks[owners[idx].first];
          if (chunks[i].ctx - kb * kKeys > o.ctx - owners[idx].second * kKeys) owners[idx] = {i, kb};
          packed_of.push_back(idx);
          continue;
        }
      }
      owners.emplace_back(i, kb);
      packed_of.push_back(idx);
    }
  }
  for (size_t i = 0, off = 0; i < chunks.size(); ++i) {
    chunks[i].packed = packed_of.data() + off;
    off += (chunks[i].ctx + kKeys - 1) / kKeys;
  }
  const int64_t block_floats = Path::kBlockFloats * HD, n_packed = static_cast<int64_t>(owners.size());
  std::unique_ptr<float[]> buf(new float[n_packed * kvh * block_floats]);  // every element is written below
  at::parallel_for(0, n_packed * kvh, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const auto [ci, kb] = owners[b % n_packed];  // head-major: a head's blocks are contiguous
      Path::template pack<C, HD>(kc, vc, sc, chunks[ci], b / n_packed, slots, bs, kb, buf.get() + b * block_floats);
    }
  });
  std::vector<Task> tasks;
  for (size_t i = 0; i < chunks.size(); ++i)
    for (int64_t t0 = 0; t0 < chunks[i].q_len; t0 += tok_per_task)
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t n = std::min(tok_per_task, chunks[i].q_len - t0);
        tasks.push_back({static_cast<int64_t>(i), h, t0, n, chunks[i].ctx - chunks[i].q_len + t0 + n});
      }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> sbuf;
    std::vector<uint16_t> pbuf;
    std::vector<const float*> blocks, vblocks;
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      const Task& t = tasks[i];
      const Chunk& c = chunks[t.chunk];
      const int64_t nkb = (c.ctx + kKeys - 1) / kKeys;
      blocks.resize(nkb);
      for (int64_t kb = 0; kb < nkb; ++kb) blocks[kb] = buf.get() + (t.head * n_packed + c.packed[kb]) * block_floats;
      Path::template attend<T, HD, Rows>(q, out, c, t, nh, g, scale, blocks.data(), sbuf, pbuf, vblocks);
    }
  });
}

template <typename T, typename C, typename Path>
static bool dispatch(const T* q, const C* kc, const C* vc, const KvScales& sc, T* out, std::vector<Chunk>& chunks,
                     int64_t nh, int64_t kvh, int64_t hd, int64_t slots, int64_t bs, float scale) {
  const int64_t g = nh / kvh;
  // rows per task: whole tokens of the query group, at most 8 (6 for a group of 3)
#define SY_PREFILL_CASE(H, R) \
  if (hd == H && (8 / g) * g == R) { run<T, C, H, R, Path>(q, kc, vc, sc, out, chunks, nh, kvh, slots, bs, scale); return true; }
  SY_PREFILL_CASE(64, 8) SY_PREFILL_CASE(64, 6) SY_PREFILL_CASE(64, 4)
  SY_PREFILL_CASE(128, 8) SY_PREFILL_CASE(128, 6) SY_PREFILL_CASE(128, 4)
#undef SY_PREFILL_CASE
  return false;
}

// Path for model-dtype caches, Int8Path for int8 ones
template <typename T, typename Path, typename Int8Path = Path>
static bool dispatch_cache(const T* q, const torch::Tensor& kc, const torch::Tensor& vc, const KvScales& sc, T* out,
                           std::vector<Chunk>& chunks, int64_t nh, int64_t kvh, int64_t hd, int64_t bs, float scale) {
  const int64_t slots = kc.size(1);
  if (kc.scalar_type() == torch::kChar)
    return dispatch<T, int8_t, Int8Path>(q, kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>(), sc, out, chunks, nh, kvh,
                                         hd, slots, bs, scale);
  return dispatch<T, T, Path>(q, kc.data_ptr<T>(), vc.data_ptr<T>(), sc, out, chunks, nh, kvh, hd, slots, bs, scale);
}

}  // namespace prefill
