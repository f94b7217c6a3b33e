// Decode attention over the page pool, in one pass per (kv head, group of rows): see replica/cpu_kernels.py.
//
// Every decode row's context is a list of segments, each a run of consecutive pool slots. Rows that share a run (a
// cached prefix in the same pages) meet in one segment, so its keys and values are read once for all of them. For
// each kv head, the `group` query heads mapped to it and the segment's rows form the query vectors; keys are read in
// blocks, converted to float32 once per block, scored against every query vector, and folded into a running softmax
// (max, sum, weighted values) per query vector. Nothing is gathered, no mask is built, no partial result leaves the
// kernel: each row's output is written once, normalised, at its packed position.
//
// Work items are (kv head, component): a component is a set of rows and the segments that touch them (a shared-run
// group with its rows' own runs, or a row alone); components have disjoint rows, so items run in parallel with no
// shared state.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "reduce16.h"
#include "step_helper.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;        // keys per block: scores for all query vectors stay in L1
constexpr float kNoScore = -1.0e30f;  // "minus infinity" that stays finite under -ffast-math

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Fold one block of a query vector's scores into its running softmax: the scores become exp(score - new max) in
// place, ``top`` / ``total`` are updated, and the factor its accumulated values must be scaled by is returned.
inline float fold_block(float* row_scores, int64_t n, float& top, float& total) {
  float block_top = kNoScore;
  for (int64_t t = 0; t < n; ++t) block_top = std::max(block_top, row_scores[t]);
  const float new_top = std::max(top, block_top);
  const float rescale = std::exp(top - new_top);
  float block_total = 0.0f;
#pragma omp simd reduction(+ : block_total)
  for (int64_t t = 0; t < n; ++t) {
    row_scores[t] = std::exp(row_scores[t] - new_top);
    block_total += row_scores[t];
  }
  total = total * rescale + block_total;
  top = new_top;
  return rescale;
}

template <typename T>
void run_item(const T* query, const T* k_cache, const T* v_cache, const int64_t* segments, const int64_t* seg_rows,
              const int64_t* component, int64_t kv_head, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              float scale, T* out) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;  // pool: [slots, kv_heads, head_dim]
  const int64_t seg_begin = component[0], seg_end = component[1];
  const int64_t row_begin = component[2], row_end = component[3];
  const int64_t num_rows = row_end - row_begin;
  const int64_t nq_all = num_rows * group;

  // running softmax state per query vector (row, query head of this kv head), indexed by the row's place in the
  // component's row list
  std::vector<float> q_all(nq_all * head_dim), acc(nq_all * head_dim, 0.0f), top(nq_all, kNoScore),
      total(nq_all, 0.0f);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t position = seg_rows[row_begin + r];
    for (int64_t g = 0; g < group; ++g) {
      float* dst = q_all.data() + (r * group + g) * head_dim;
      to_float(query + (position * num_heads + kv_head * group + g) * head_dim, dst, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] *= scale;
    }
  }
  std::vector<float> keys(kBlock * head_dim), values(kBlock * head_dim), scores;
  std::vector<int64_t> local;  // per segment: its rows' places in the component's row list
  for (int64_t s = seg_begin; s < seg_end; ++s) {
    const int64_t* seg = segments + s * 4;
    const int64_t start = seg[0], length = seg[1];
    local.clear();
    for (int64_t i = seg[2]; i < seg[3]; ++i) {
      const int64_t position = seg_rows[i];
      int64_t r = 0;
      while (seg_rows[row_begin + r] != position) ++r;
      local.push_back(r);
    }
    const int64_t nq = static_cast<int64_t>(local.size()) * group;
    scores.resize(nq * kBlock);
    for (int64_t b = 0; b < length; b += kBlock) {
      const int64_t n = std::min(kBlock, length - b);
      const T* k_base = k_cache + (start + b) * slot_stride + kv_head * head_dim;
      const T* v_base = v_cache + (start + b) * slot_stride + kv_head * head_dim;
      for (int64_t t = 0; t < n; ++t) to_float(k_base + t * slot_stride, keys.data() + t * head_dim, head_dim);
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t vec = local[qi / group] * group + qi % group;
        const float* q = q_all.data() + vec * head_dim;
        float* row_scores = scores.data() + qi * kBlock;
        for (int64_t t = 0; t < n; ++t) {
          const float* k = keys.data() + t * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * k[d];
          row_scores[t] = dot;
        }
        const float rescale = fold_block(row_scores, n, top[vec], total[vec]);
        if (rescale != 1.0f) {
          float* a = acc.data() + vec * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale;
        }
      }
      for (int64_t t = 0; t < n; ++t) to_float(v_base + t * slot_stride, values.data() + t * head_dim, head_dim);
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t vec = local[qi / group] * group + qi % group;
        float* a = acc.data() + vec * head_dim;
        const float* p = scores.data() + qi * kBlock;
        for (int64_t t = 0; t < n; ++t) {
          const float weight = p[t];
          const float* v = values.data() + t * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * v[d];
        }
      }
    }
  }
  std::vector<float> result(head_dim);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t position = seg_rows[row_begin + r];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t vec = r * group + g;
      const float inverse = total[vec] > 0.0f ? 1.0f / total[vec] : 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) result[d] = acc[vec * head_dim + d] * inverse;
      from_float(result.data(), out + (position * num_heads + kv_head * group + g) * head_dim, head_dim);
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The same computation with head_dim = kW * N on the CPU's widest float vectors (kW = 16 on AVX-512, 8 on AVX2; used
// where the CPU has them, see ``vector_item``): keys are scored kW at a time (``reduce_keys``: one vector of kW scores
// from kW partial-sum vectors, in place of a horizontal sum per key), in bfloat16 pairs where the CPU has
// AVX512-BF16; a value row is converted to float once and added into up to `kTile` query vectors' accumulators held
// in registers; the next block of keys and values is prefetched while one is attended. Against session 18's version
// of this code (a key widened and dotted with each query vector, a horizontal sum per score, no prefetch;
// benchmarks/decode_kernel.py, BENCHMARKS.md section 0k) on a Zen 4 EPYC: bfloat16 0.63-0.93x the time (1.06x for 4
// rows of their own 1792 keys on 2 threads), float32 0.76-1.05x. On AVX2 the 16-float version lost to the plain
// loops (GCC split its vectors into register pairs and spilled the accumulator tiles); with 8-float vectors and tiles
// sized to 16 registers it takes 0.5-0.7x their time on a Zen 1 EPYC (section 0v).
#if defined(__AVX512F__)
constexpr int kW = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
typedef uint32_t vbits __attribute__((vector_size(64)));
// Keys are scored 16 at a time: accumulator j holds key kKeyOf[j]'s lane-wise products with the query vector and
// ``reduce16`` (reduce16.h) folds the 16 into one vector of their scores, lane j key j.
using prefixserve::kKeyOf;
inline vfloat reduce_keys(const vfloat* parts) {
  __m512 v[16];
  std::memcpy(v, parts, sizeof(v));
  return (vfloat)prefixserve::reduce16(v);
}
#else
constexpr int kW = 8;
typedef float vfloat __attribute__((vector_size(32)));
typedef uint16_t vhalf __attribute__((vector_size(16)));
typedef uint32_t vbits __attribute__((vector_size(32)));
constexpr int kKeyOf[8] = {0, 1, 2, 3, 4, 5, 6, 7};
// Eight 8-float vectors summed lane-wise into one, lane j the sum of vector j: two rounds of pairwise adds within
// 128-bit halves, then the halves of four vectors each added across.
inline vfloat reduce_keys(const vfloat* parts) {
  __m256 v[8];
  std::memcpy(v, parts, sizeof(v));
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return (vfloat)_mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

inline vfloat loadw(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfloat loadw(const c10::BFloat16* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vbits bits = __builtin_convertvector(h, vbits) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline vfloat loadw(const c10::Half* p) {
  float tmp[kW];
  for (int i = 0; i < kW; ++i) tmp[i] = static_cast<float>(p[i]);
  return loadw(tmp);
}

// One query vector as the score loop wants it: float32 lanes, or, for bfloat16 on a CPU with AVX512-BF16, the
// bfloat16 values themselves, dotted with a key's bfloat16 pairs by vdpbf16ps (products exact, sums in float32), so
// the keys are never widened.
template <typename T, int N>
struct Query {
  vfloat lanes[N];
  void set(const T* src) {
    for (int c = 0; c < N; ++c) lanes[c] = loadw(src + kW * c);
  }
  vfloat dot(const T* key) const {
    vfloat sum = lanes[0] * loadw(key);
    for (int c = 1; c < N; ++c) sum += lanes[c] * loadw(key + kW * c);
    return sum;
  }
};

#if defined(__AVX512BF16__)
// 32 bfloat16 values from p, or 16 and zeros when only 16 remain (head_dim an odd multiple of 16)
template <bool kHalfOnly>
inline __m512bh load_pairs(const c10::BFloat16* p) {
  if constexpr (kHalfOnly)
    return (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (__m512bh)_mm512_loadu_si512(p);
}

template <int N>
struct Query<c10::BFloat16, N> {
  static constexpr int kPairs = (N + 1) / 2;
  __m512bh pairs[kPairs];
  void set(const c10::BFloat16* src) {
    for (int c = 0; c < N / 2; ++c) pairs[c] = load_pairs<false>(src + 32 * c);
    if constexpr (N % 2 == 1) pairs[N / 2] = load_pairs<true>(src + 32 * (N / 2));
  }
  vfloat dot(const c10::BFloat16* key) const {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < N / 2; ++c) sum = _mm512_dpbf16_ps(sum, pairs[c], load_pairs<false>(key + 32 * c));
    if constexpr (N % 2 == 1) sum = _mm512_dpbf16_ps(sum, pairs[N / 2], load_pairs<true>(key + 32 * (N / 2)));
    return (vfloat)sum;
  }
};
#endif

template <typename T, int N>
void run_item_vec(const T* query, const T* k_cache, const T* v_cache, const int64_t* segments, const int64_t* seg_rows,
                  const int64_t* component, int64_t head_begin, int64_t head_end, int64_t num_heads,
                  int64_t num_kv_heads, float scale, T* out) {
  // kv heads [head_begin, head_end) of one component; the head loop sits inside the key-block loop so that one block
  // of slots is read whole (all its heads) before the next
  constexpr int64_t head_dim = kW * N;
  // accumulator tiles sized to the register file: 32 vector registers on AVX-512, 16 on AVX2
  constexpr int64_t kTile = kW == 16 ? (N >= 8 ? 2 : 4) : (N >= 6 ? 1 : 2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t seg_begin = component[0], seg_end = component[1];
  const int64_t row_begin = component[2], row_end = component[3];
  const int64_t num_rows = row_end - row_begin;
  const int64_t nq_all = num_rows * group;
  const int64_t num_local_heads = head_end - head_begin;

  // state index: (local head, row place in the component, query head of the group)
  std::vector<Query<T, N>> q_all(num_local_heads * nq_all);
  std::vector<vfloat> acc(num_local_heads * nq_all * N);
  std::vector<float> top(num_local_heads * nq_all, kNoScore), total(num_local_heads * nq_all, 0.0f);
  for (auto& a : acc) a = vfloat{};
  for (int64_t h = 0; h < num_local_heads; ++h)
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t position = seg_rows[row_begin + r];
      for (int64_t g = 0; g < group; ++g)
        q_all[h * nq_all + r * group + g].set(query +
                                              (position * num_heads + (head_begin + h) * group + g) * head_dim);
    }
  std::vector<float> scores;
  std::vector<int64_t> vecs;  // per segment: the query vectors (places in the state, head 0) of its rows
  for (int64_t s = seg_begin; s < seg_end; ++s) {
    const int64_t* seg = segments + s * 4;
    const int64_t start = seg[0], length = seg[1];
    vecs.clear();
    for (int64_t i = seg[2]; i < seg[3]; ++i) {
      int64_t r = 0;
      while (seg_rows[row_begin + r] != seg_rows[i]) ++r;
      for (int64_t g = 0; g < group; ++g) vecs.push_back(r * group + g);
    }
    const int64_t nq = static_cast<int64_t>(vecs.size());
    scores.resize(nq * kBlock);
    for (int64_t b = 0; b < length; b += kBlock) {
      const int64_t n = std::min(kBlock, length - b);
      {  // the next block of keys and values (this segment's, or the next one's first) on its way while this one runs
        int64_t next_start = start + b + kBlock, next_n = std::min(kBlock, length - b - kBlock);
        if (next_n <= 0 && s + 1 < seg_end) {
          next_start = segments[(s + 1) * 4];
          next_n = std::min(kBlock, segments[(s + 1) * 4 + 1]);
        }
        const int64_t first = head_begin * head_dim * sizeof(T), bytes = num_local_heads * head_dim * sizeof(T);
        for (int64_t t = 0; t < next_n; ++t) {
          const char* kp = reinterpret_cast<const char*>(k_cache + (next_start + t) * slot_stride) + first;
          const char* vp = reinterpret_cast<const char*>(v_cache + (next_start + t) * slot_stride) + first;
          for (int64_t off = 0; off < bytes; off += 64) {
            _mm_prefetch(kp + off, _MM_HINT_T1);
            _mm_prefetch(vp + off, _MM_HINT_T1);
          }
        }
      }
      for (int64_t h = 0; h < num_local_heads; ++h) {
        const int64_t base = h * nq_all;
        const T* k_base = k_cache + (start + b) * slot_stride + (head_begin + h) * head_dim;
        const T* v_base = v_cache + (start + b) * slot_stride + (head_begin + h) * head_dim;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const Query<T, N>& q = q_all[base + vecs[qi]];
          for (int64_t t0 = 0; t0 < n; t0 += kW) {
            const int64_t m = std::min<int64_t>(kW, n - t0);
            vfloat parts[kW];
#pragma GCC unroll 16
            for (int j = 0; j < kW; ++j)
              parts[j] = kKeyOf[j] < m ? q.dot(k_base + (t0 + kKeyOf[j]) * slot_stride) : vfloat{};
            const vfloat block_scores = reduce_keys(parts) * scale;
            std::memcpy(scores.data() + qi * kBlock + t0, &block_scores, sizeof(block_scores));
          }
        }
        for (int64_t qi = 0; qi < nq; ++qi) {
          const int64_t vec = base + vecs[qi];
          const float rescale = fold_block(scores.data() + qi * kBlock, n, top[vec], total[vec]);
          if (rescale != 1.0f)
            for (int c = 0; c < N; ++c) acc[vec * N + c] *= rescale;
        }
        for (int64_t q0 = 0; q0 < nq; q0 += kTile) {
          const int64_t tile = std::min(kTile, nq - q0);
          vfloat a[kTile][N];
          for (int64_t j = 0; j < tile; ++j)
            for (int c = 0; c < N; ++c) a[j][c] = acc[(base + vecs[q0 + j]) * N + c];
          for (int64_t t = 0; t < n; ++t) {
            if constexpr (kW == 16) {
              vfloat v[N];
              for (int c = 0; c < N; ++c) v[c] = loadw(v_base + t * slot_stride + kW * c);
              for (int64_t j = 0; j < tile; ++j) {
                const float weight = scores[(q0 + j) * kBlock + t];
                for (int c = 0; c < N; ++c) a[j][c] += weight * v[c];
              }
            } else {  // 16 registers: a value vector at a time, the tile's loop unrolled so `a` stays in registers
              for (int c = 0; c < N; ++c) {
                const vfloat v = loadw(v_base + t * slot_stride + kW * c);
#pragma GCC unroll 4
                for (int64_t j = 0; j < kTile; ++j)
                  if (j < tile) a[j][c] += scores[(q0 + j) * kBlock + t] * v;
              }
            }
          }
          for (int64_t j = 0; j < tile; ++j)
            for (int c = 0; c < N; ++c) acc[(base + vecs[q0 + j]) * N + c] = a[j][c];
        }
      }
    }
  }
  float result[head_dim];
  for (int64_t h = 0; h < num_local_heads; ++h)
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t position = seg_rows[row_begin + r];
      for (int64_t g = 0; g < group; ++g) {
        const int64_t vec = h * nq_all + r * group + g;
        const float inverse = total[vec] > 0.0f ? 1.0f / total[vec] : 0.0f;
        for (int c = 0; c < N; ++c) {
          const vfloat o = acc[vec * N + c] * inverse;
          std::memcpy(result + kW * c, &o, sizeof(o));
        }
        from_float(result, out + (position * num_heads + (head_begin + h) * group + g) * head_dim, head_dim);
      }
    }
}

#endif  // AVX-512, or AVX2 and FMA

template <typename T>
using ItemFn = void (*)(const T*, const T*, const T*, const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, float, T*);

template <typename T>
ItemFn<T> vector_item(int64_t head_dim) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  switch (head_dim) {
    case 32: return &run_item_vec<T, 32 / kW>;
    case 64: return &run_item_vec<T, 64 / kW>;
    case 80: return &run_item_vec<T, 80 / kW>;
    case 96: return &run_item_vec<T, 96 / kW>;
    case 128: return &run_item_vec<T, 128 / kW>;
    case 256: return &run_item_vec<T, 256 / kW>;
    default: return nullptr;
  }
#else
  (void)head_dim;
  return nullptr;
#endif
}

// query [T, H, D]; k_cache / v_cache [slots, KVH, D] (contiguous); segments [S, 4] int64 (first slot, length, rows
// begin, rows end into seg_rows); seg_rows int64 packed positions; components [C, 4] int64 (segments begin/end,
// component rows begin/end into seg_rows). Writes out[position] for every component row.
void decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& segments, const at::Tensor& seg_rows, const at::Tensor& components,
                      at::Tensor& out, double scale, bool use_vector_code) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.sizes() == query.sizes(),
              "decode_attention: bad shapes");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "decode_attention: tensors must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "decode_attention: dtypes differ");
  TORCH_CHECK(segments.scalar_type() == at::kLong && seg_rows.scalar_type() == at::kLong &&
                  components.scalar_type() == at::kLong && segments.is_contiguous() && seg_rows.is_contiguous() &&
                  components.is_contiguous() && segments.dim() == 2 && segments.size(1) == 4 &&
                  components.dim() == 2 && components.size(1) == 4,
              "decode_attention: index tensors must be contiguous int64, segments and components [N, 4]");
  const int64_t num_heads = query.size(1), head_dim = query.size(2), num_kv_heads = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0), num_tokens = query.size(0);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(2) == head_dim, "decode_attention: head mismatch");
  const int64_t num_segments = segments.size(0), num_components = components.size(0);
  const int64_t num_seg_rows = seg_rows.numel();
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* rows = seg_rows.data_ptr<int64_t>();
  const int64_t* comp = components.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_segments; ++s) {  // bounds: a bad plan must not read outside the pool
    TORCH_CHECK(seg[s * 4] >= 0 && seg[s * 4 + 1] >= 0 && seg[s * 4 + 1] <= num_slots - seg[s * 4],
                "decode_attention: segment outside the pool");
    TORCH_CHECK(0 <= seg[s * 4 + 2] && seg[s * 4 + 2] <= seg[s * 4 + 3] && seg[s * 4 + 3] <= num_seg_rows,
                "decode_attention: bad segment rows");
  }
  for (int64_t i = 0; i < num_seg_rows; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < num_tokens, "decode_attention: row outside the batch");
  for (int64_t c = 0; c < num_components; ++c) {
    TORCH_CHECK(0 <= comp[c * 4] && comp[c * 4] <= comp[c * 4 + 1] && comp[c * 4 + 1] <= num_segments &&
                    0 <= comp[c * 4 + 2] && comp[c * 4 + 2] <= comp[c * 4 + 3] && comp[c * 4 + 3] <= num_seg_rows,
                "decode_attention: bad component");
    for (int64_t s = comp[c * 4]; s < comp[c * 4 + 1]; ++s)
      for (int64_t i = seg[s * 4 + 2]; i < seg[s * 4 + 3]; ++i) {
        bool found = false;
        for (int64_t r = comp[c * 4 + 2]; r < comp[c * 4 + 3] && !found; ++r) found = rows[r] == rows[i];
        TORCH_CHECK(found, "decode_attention: a segment row is not in its component");
      }
  }
  const float fscale = static_cast<float>(scale);
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const ItemFn<scalar_t> vectorised = use_vector_code ? vector_item<scalar_t>(head_dim) : nullptr;
    // a step on one torch thread with the step helper armed (step_helper.h) shares its items with the helper: a
    // decode batch over long contexts is bound by reading its K/V, which two cores read faster than one
    if (vectorised) {
      // items: (component, chunk of kv heads); heads are split only as far as the threads need work (with the
      // helper, one kv head an item: it takes them as it is free)
      const int64_t threads = at::get_num_threads();
      const bool with_helper = prefixserve::helper_shares_step();
      const int64_t chunks = with_helper ? num_kv_heads
                                         : std::min(num_kv_heads, std::max<int64_t>(1, (threads + num_components - 1) /
                                                                                           num_components));
      const int64_t per_chunk = (num_kv_heads + chunks - 1) / chunks;
      prefixserve::share_or_parallel_for(num_components * chunks, 1, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t c = item / chunks, h0 = (item % chunks) * per_chunk;
          const int64_t h1 = std::min(num_kv_heads, h0 + per_chunk);
          if (h0 < h1) vectorised(q, k, v, seg, rows, comp + c * 4, h0, h1, num_heads, num_kv_heads, fscale, o);
        }
      });
      return;
    }
    prefixserve::share_or_parallel_for(num_kv_heads * num_components, 1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kv_head = item % num_kv_heads, c = item / num_kv_heads;
        run_item<scalar_t>(q, k, v, seg, rows, comp + c * 4, kv_head, num_heads, num_kv_heads, head_dim, fscale, o);
      }
    });
  };
  switch (query.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 only");
  }
}

// One layer's attention in a step whose every part runs on these kernels (replica.paged_attention.attend's one-call
// path): the first num_real rows of key / value [T, KVH, D] are stored into layer `layer` of kv_cache
// [L, 2, ..., KVH, D] at slot_mapping [num_real]; each prompt chunk p (prefill_rows[p] = first row, rows) is attended
// by the float32 / pair-dot prefill kernel over its key runs prefill_runs[run_offsets[p] .. run_offsets[p + 1]); the
// decode rows (segments / seg_rows / components, none when components is empty) by decode_attention. Returns out
// [T, H, D], rows none of them names (padding) zero. One call where attend made ~20 tensor calls from Python for the
// same work (~25 us a layer).
at::Tensor attend_layer(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                        int64_t layer, const at::Tensor& slot_mapping, int64_t num_real,
                        const at::Tensor& prefill_rows, const at::Tensor& prefill_runs,
                        const at::Tensor& run_offsets, const at::Tensor& segments, const at::Tensor& seg_rows,
                        const at::Tensor& components, double scale) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && query.dim() == 3 && query.size(0) == key.size(0),
              "attend_layer: bad shapes");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() >= 3 && kv_cache.size(1) == 2 && layer >= 0 &&
                  layer < kv_cache.size(0),
              "attend_layer: bad pool or layer");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "attend_layer: dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && num_real >= 0 &&
                  slot_mapping.numel() == num_real && num_real <= key.size(0),
              "attend_layer: bad slot mapping");
  const int64_t num_prefills = prefill_rows.numel() / 2;
  TORCH_CHECK(prefill_rows.scalar_type() == at::kLong && prefill_rows.is_contiguous() &&
                  prefill_rows.numel() % 2 == 0 && run_offsets.scalar_type() == at::kLong &&
                  run_offsets.is_contiguous() && run_offsets.numel() == num_prefills + 1 &&
                  prefill_runs.scalar_type() == at::kLong && prefill_runs.is_contiguous() &&
                  prefill_runs.numel() % 2 == 0,
              "attend_layer: bad prompt chunks");
  const int64_t kv_heads = key.size(1), head_dim = key.size(2), num_tokens = query.size(0);
  const at::Tensor layer_cache = kv_cache.select(0, layer);
  at::Tensor k_cache = layer_cache.select(0, 0).view({-1, kv_heads, head_dim});
  at::Tensor v_cache = layer_cache.select(0, 1).view({-1, kv_heads, head_dim});
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const int64_t row_bytes = kv_heads * head_dim * static_cast<int64_t>(k.element_size());
  const int64_t num_slots = k_cache.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t i = 0; i < num_real; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "attend_layer: slot outside the pool");
    std::memcpy(k_dst + slots[i] * row_bytes, k_src + i * row_bytes, row_bytes);
    std::memcpy(v_dst + slots[i] * row_bytes, v_src + i * row_bytes, row_bytes);
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::zeros(query.sizes(), query.options());
  if (num_prefills > 0) {  // the prefill kernel lives in another source file: reached through the dispatcher
    static const auto prefill = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("prefixserve_cpu::prefill_attention_f32", "")
                                    .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, double, at::Tensor&, bool)>();
    const int64_t* rows = prefill_rows.data_ptr<int64_t>();
    const int64_t* offsets = run_offsets.data_ptr<int64_t>();
    const int64_t num_runs = prefill_runs.numel() / 2;
    const at::Tensor runs = prefill_runs.view({num_runs, 2});
    for (int64_t p = 0; p < num_prefills; ++p) {
      TORCH_CHECK(rows[2 * p] >= 0 && rows[2 * p + 1] > 0 && rows[2 * p] + rows[2 * p + 1] <= num_tokens &&
                      0 <= offsets[p] && offsets[p] < offsets[p + 1] && offsets[p + 1] <= num_runs,
                  "attend_layer: prompt chunk outside the step");
      at::Tensor chunk_out = out.narrow(0, rows[2 * p], rows[2 * p + 1]);
      prefill.call(q.narrow(0, rows[2 * p], rows[2 * p + 1]), k_cache, v_cache,
                   runs.narrow(0, offsets[p], offsets[p + 1] - offsets[p]), scale, chunk_out, true);
    }
  }
  if (components.numel() > 0) decode_attention(q, k_cache, v_cache, segments, seg_rows, components, out, scale, true);
  return out;
}

}  // namespace

TORCH_LIBRARY(prefixserve_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor segments, Tensor seg_rows, "
        "Tensor components, Tensor(a!) out, float scale, bool vector_code=True) -> ()");
  m.def("attend_layer(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, "
        "int num_real, Tensor prefill_rows, Tensor prefill_runs, Tensor run_offsets, Tensor segments, "
        "Tensor seg_rows, Tensor components, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("attend_layer", &attend_layer);
}
