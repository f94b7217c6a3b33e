// Prefill attention in float32 on AVX2 + FMA vectors, 512-bit ones where the CPU has AVX-512 (the AMX kernel in
// amx_attention.cpp covers bfloat16 where the CPU has AMX tiles): one prompt chunk's query tokens against their whole
// context, the cached part and the chunk's own tokens (causal), wherever its pages lie in the pool. See
// replica/cpu_kernels.py (``prefill_attention``). bfloat16 on a CPU without AMX comes here too: with AVX512-BF16 (e.g. a
// Zen 4 EPYC) to the vdpbf16ps kernel further down (``bf16dot``); otherwise the query and each block of keys and values
// are widened to float32 as they are packed, the arithmetic is the float32 kernel's, and the output is rounded to
// bfloat16 once.
//
// Before it, float32 chunks were attended run by run by ATen's flash kernel, one call per run of consecutive pool
// slots, and the parts merged by their log-sum-exp in Python: on a 2-core AVX2 EPYC that path spent ~9 ms per layer on
// 64 new tokens after 2048 cached ones, where one flash call on contiguous keys takes ~4.4 ms.
//
// Here one pass per (kv head, 16 query rows) keeps a single running softmax over every key, read in place from the
// pool. Both products are computed transposed, so that each vector (``V16``: one 512-bit register with AVX-512, two
// 8-float halves on AVX2) holds one key's (or one head dim's) value for the 16 rows and the softmax needs no
// horizontal reductions:
//
//   S^T = K Q^T     Q^T (head dim x 16 rows, pre-scaled by scale * log2(e)) packed once per item; each key's dims
//                   are broadcast from the pool, kTile keys of running sums at a time (AVX-512: 8 registers;
//                   AVX2: 6 keys x 2 halves, 12 registers)
//   softmax         per block of up to 64 keys: elementwise maximum over the keys, exp2 by a polynomial (degree 6,
//                   relative error ~1e-7), the running sums and O^T rescaled when a row's maximum moves
//   O^T += V^T P^T  each key's values broadcast from the pool, kTile head dims at a time
//
// Query rows are (token, query head of the kv head) pairs, so the query heads sharing a kv head (GQA) read its keys
// once. An item is one kv head and up to 8 blocks of 16 rows: each block of 64 keys and values is attended by all of the
// item's row blocks in turn while it is in L1 / L2 (copied once out of the pool into a packed buffer first when the
// item has 4 row blocks or more).
// (Before, each item was 16 rows: a kv head's keys and values for a 2048-token context, 1 MiB in float32 at head size
// 64 and more than one core's L2, came from L3 or memory again for every 16 rows, in pool rows 1 KiB apart that map
// onto a quarter of L1's sets: 10-16% slower alone, more in an engine step after the weights have gone through the
// caches.) Items are independent and run in parallel; each writes its rows' outputs in place. With AVX-512 the row
// blocks that see a key block are attended two at a time (``attend_blocks<2>``): each key's and value's broadcast
// serves 32 rows and 12 chains of FMAs are in flight, with every sum in the same order (the same bits). The kernel
// alone on the Zen 5 EPYC, one thread, 64 new tokens after 2048 cached: 152-168 -> 177-182 GFLOP/s, interleaved on a
// noisy box.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXSERVE_VEC_PREFILL 1
#endif

namespace {

#ifdef PREFIXSERVE_VEC_PREFILL

constexpr int64_t kRows = 16;          // query rows per item: one V16 (below)
constexpr int64_t kKeys = 64;          // keys per softmax block
constexpr int64_t kMaxDim = 256;
constexpr float kNoScore = -1.0e30f;   // finite "minus infinity" (-ffast-math)
constexpr float kLog2e = 1.44269504088896340736f;

// 2^f for |f| <= 1/2 by its Taylor series to degree 6, highest power first (Horner): ln(2)^k / k!, k = 6 .. 0
constexpr float kExp2Taylor[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                  5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

// 2^t for 8 floats: 2^n * 2^f with n = round(t), |f| <= 1/2, 2^f by kExp2Taylor (relative error ~1.2e-7, float32's
// own rounding is 6e-8); t below -126 (a masked or negligible score) gives exactly 0
inline __m256 exp2_8(__m256 t) {
  const __m256 keep = _mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Taylor[0]);
  for (int k = 1; k < 7; ++k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[k]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), keep);
}

#if defined(__AVX512F__)
inline __m512 exp2_16(__m512 t) {  // 2^t as exp2_8, 16 floats; t below -126 gives exactly 0
  const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[k]));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

// The float32 kernel's vector: the 16 rows of a row block. One 512-bit register with AVX-512 (on the Zen 5 EPYC the
// AVX2 build of this kernel ran at 221 GFLOP/s on two cores, half of what its 512-bit FMA units give), else two 8-float
// halves. kTile: the keys (or head dims) of one register tile, accumulated side by side.
constexpr int kTile = 8;
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 all(float x) { return {_mm512_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 exp2v(V16 t) { return {exp2_16(t.v)}; }
inline V16 hidden_from(V16 s, float at, V16 limit) {  // kNoScore in the rows whose limit is at most ``at``
  return {_mm512_mask_mov_ps(s.v, _mm512_cmp_ps_mask(_mm512_set1_ps(at), limit.v, _CMP_GE_OQ),
                             _mm512_set1_ps(kNoScore))};
}
inline bool differs(V16 a, float x) { return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_NEQ_UQ) != 0; }
#else
constexpr int kTile = 6;  // 6 x 2 halves: 12 of the 16 AVX2 registers
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 all(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 exp2v(V16 t) { return {exp2_8(t.lo), exp2_8(t.hi)}; }
inline V16 hidden_from(V16 s, float at, V16 limit) {  // kNoScore in the rows whose limit is at most ``at``
  const __m256 position = _mm256_set1_ps(at), none = _mm256_set1_ps(kNoScore);
  return {_mm256_blendv_ps(s.lo, none, _mm256_cmp_ps(position, limit.lo, _CMP_GE_OQ)),
          _mm256_blendv_ps(s.hi, none, _mm256_cmp_ps(position, limit.hi, _CMP_GE_OQ))};
}
inline bool differs(V16 a, float x) {
  const __m256 value = _mm256_set1_ps(x);
  return _mm256_movemask_ps(_mm256_cmp_ps(a.lo, value, _CMP_NEQ_UQ)) |
         _mm256_movemask_ps(_mm256_cmp_ps(a.hi, value, _CMP_NEQ_UQ));
}
#endif

// bfloat16 <-> float32: a bfloat16 is the top half of a float32; float32 -> bfloat16 rounds to nearest even (as torch)
inline float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// ``count`` bfloat16 values at ``from`` as float32 at ``to``
inline void widen(const uint16_t* from, int64_t count, float* to) {
  int64_t d = 0;
  for (; d + 8 <= count; d += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + d));
    _mm256_storeu_ps(to + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
  for (; d < count; ++d) to[d] = bf16_to_f32(from[d]);
}

struct Chunk {
  // float32, or bfloat16 (``bf16``: the kernel reads the query and each key block widened to float32, computes as for
  // float32, and rounds the output once)
  const void* query;  // [tokens, heads, dim]
  void* out;
  const void* k;      // a layer's pool [slots, kv_heads, dim]
  const void* v;
  const int64_t* runs;  // [R, 2]: first slot, length
  int64_t num_runs;
  int64_t num_heads, group, num_rows, head_dim, slot_stride;
  int64_t cached;       // keys before the chunk's own tokens
  float scale;
  bool bf16;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The next key block's keys and values (one kv head's rows of them), asked for a few cache lines at a time while the
// current block is attended (``step`` after each tile), so that they come from memory under the arithmetic. In an
// engine step the pool's rows are in memory, not in the caches (the layers' weights passed through them since): the
// kernel alone over 30 layers' pools in turn, one thread, took ~25% longer than over one layer's, and the time was
// the first row blocks' reads of each key block (the data movement alone: 60 us a layer from L3, 205 from memory).
// The hardware prefetchers do not see these rows (one kv head's slice of every slot: 128 bytes of 512 for the tiny
// Llama in bfloat16), and asking for a whole block at once did nothing (the requests past the core's few outstanding
// misses wait or are dropped). Spread over the tiles: bfloat16 SmolLM2 in a warm request, 522 -> 455 us a layer; the
// tiny Llama 479 -> 400 (in-process A/B, benchmarks/results/s47/scratch/warm_ab.py).
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t stride = 0, row = 0, lines = 0, total = 0, next = 0, per_step = 0;

  // the block at ``start`` in run ``r`` (past its end: the next nonempty run's first), over ``steps`` calls of
  // ``step`` (none: nothing asked for)
  void aim(const Chunk& c, int64_t h, int64_t r, int64_t start, int64_t bytes, int64_t steps) {
    next = total = 0;
    while (r < c.num_runs && start >= c.runs[2 * r + 1]) ++r, start = 0;
    if (r >= c.num_runs || steps <= 0) return;
    const int64_t count = std::min(kKeys, c.runs[2 * r + 1] - start);
    const int64_t first = ((c.runs[2 * r] + start) * c.slot_stride + h * c.head_dim) * bytes;
    k = static_cast<const char*>(c.k) + first;
    v = static_cast<const char*>(c.v) + first;
    stride = c.slot_stride * bytes;
    row = c.head_dim * bytes;
    const bool aligned = (reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) | stride) % 64 == 0;
    lines = (row + 63) / 64 + (aligned ? 0 : 1);  // a row that starts inside a line may end in one more
    total = 2 * count * lines;
    per_step = ceil_div(total, steps);
  }
  void step() {
    for (const int64_t end = std::min(total, next + per_step); next < end; ++next) {
      const int64_t line = next % lines, pool = next / lines % 2, key = next / lines / 2;
      _mm_prefetch((pool ? v : k) + key * stride + std::min(line * 64, row - 1), _MM_HINT_T0);
    }
  }
};

// Keys (or head dims) a tile when two row blocks are attended at once (``attend_blocks<2>``, AVX-512): 6 x 2 = 12 FMA
// chains in flight, one broadcast per two FMAs
constexpr int64_t kPairTile = 6;

// S^T for N (<= kTile) consecutive keys at ``key`` (pool rows ``slot_stride`` apart) against B row blocks' 16 rows each
// (``qt[b]`` into ``st[b]``): each key's value is broadcast once for all B, and B x N sums are in flight
template <int N, int B>
inline void scores(const float* key, int64_t slot_stride, const float* const* qt, int64_t head_dim, float* const* st) {
  V16 acc[B][N];
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n] = V16::zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    V16 q[B];
    for (int b = 0; b < B; ++b) q[b] = V16::load(qt[b] + d * kRows);
    for (int n = 0; n < N; ++n) {
      const V16 k = V16::all(key[n * slot_stride + d]);
      for (int b = 0; b < B; ++b) acc[b][n] = fmadd(k, q[b], acc[b][n]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n].store(st[b] + n * kRows);
}

// O^T[d .. d+N) += V^T P^T over ``count`` consecutive keys at ``value`` (head dims d.. of each), for B row blocks
// (``pt[b]``, ``ot[b]``): each value broadcast once for all B
template <int N, int B>
inline void values(const float* value, int64_t slot_stride, const float* const* pt, int64_t count, float* const* ot) {
  V16 acc[B][N];
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n] = V16::load(ot[b] + n * kRows);
  for (int64_t j = 0; j < count; ++j) {
    V16 p[B];
    for (int b = 0; b < B; ++b) p[b] = V16::load(pt[b] + j * kRows);
    const float* vj = value + j * slot_stride;
    for (int n = 0; n < N; ++n) {
      const V16 v = V16::all(vj[n]);
      for (int b = 0; b < B; ++b) acc[b][n] = fmadd(v, p[b], acc[b][n]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n].store(ot[b] + n * kRows);
}

template <int B>
void scores_any(int n, const float* key, int64_t stride, const float* const* qt, int64_t dim, float* const* st) {
  switch (n) {
#if defined(__AVX512F__)
    case 8: scores<8, B>(key, stride, qt, dim, st); break;
    case 7: scores<7, B>(key, stride, qt, dim, st); break;
#endif
    case 6: scores<6, B>(key, stride, qt, dim, st); break;
    case 5: scores<5, B>(key, stride, qt, dim, st); break;
    case 4: scores<4, B>(key, stride, qt, dim, st); break;
    case 3: scores<3, B>(key, stride, qt, dim, st); break;
    case 2: scores<2, B>(key, stride, qt, dim, st); break;
    default: scores<1, B>(key, stride, qt, dim, st); break;
  }
}

template <int B>
void values_any(int n, const float* value, int64_t stride, const float* const* pt, int64_t count, float* const* ot) {
  switch (n) {
#if defined(__AVX512F__)
    case 8: values<8, B>(value, stride, pt, count, ot); break;
    case 7: values<7, B>(value, stride, pt, count, ot); break;
#endif
    case 6: values<6, B>(value, stride, pt, count, ot); break;
    case 5: values<5, B>(value, stride, pt, count, ot); break;
    case 4: values<4, B>(value, stride, pt, count, ot); break;
    case 3: values<3, B>(value, stride, pt, count, ot); break;
    case 2: values<2, B>(value, stride, pt, count, ot); break;
    default: values<1, B>(value, stride, pt, count, ot); break;
  }
}

// Which 16 query rows a row block holds, how far each sees, and their running softmax: O^T (unnormalized), maxima and
// sums (log2 domain). The part both kernels' row states share.
struct RowBlock {
  alignas(64) float limit[kRows];  // a row sees keys below its limit
  int64_t rows, first, min_limit;
  float max_limit;
  float* ot;  // [dim, 16]
  V16 m, l;

  void begin(const Chunk& c, int64_t first_row, float* out_t) {
    ot = out_t;
    std::fill(ot, ot + c.head_dim * kRows, 0.0f);
    m = V16::all(kNoScore);
    l = V16::zero();
    first = first_row;
    rows = std::min(kRows, c.num_rows - first);
    max_limit = 0.0f;
    for (int64_t i = 0; i < kRows; ++i) {  // rows past the chunk repeat the last one's limit
      limit[i] = static_cast<float>(c.cached + (first + std::min(i, rows - 1)) / c.group + 1);
      max_limit = std::max(max_limit, limit[i]);
    }
    min_limit = static_cast<int64_t>(limit[0]);
  }

  // A block's scores S^T ([count, 16] at ``st``, keys from the context's ``position``-th on): hides each row's keys
  // past its causal limit, moves the maxima ``m`` over the block, and returns the factor the earlier sums and O^T take
  V16 advance(float* st, int64_t count, int64_t position) {
    const V16 limits = V16::load(limit);
    const bool masked = position + count > min_limit;
    V16 top = V16::all(kNoScore);
    for (int64_t j = 0; j < count; ++j) {
      V16 row = V16::load(st + j * kRows);
      if (masked) {
        row = hidden_from(row, static_cast<float>(position + j), limits);
        row.store(st + j * kRows);
      }
      top = vmax(top, row);
    }
    const V16 next = vmax(m, top), factor = exp2v(m - next);
    m = next;
    return factor;
  }

  // the block's probabilities summed to ``sum``: the sums and O^T rescaled by ``factor`` (O^T only where a maximum
  // moved) before the block's values are added
  void rescale(V16 factor, V16 sum, int64_t position, int64_t dim) {
    l = fmadd(l, factor, sum);
    if (position > 0 && differs(factor, 1.0f))
      for (int64_t d = 0; d < dim; ++d) (V16::load(ot + d * kRows) * factor).store(ot + d * kRows);
  }

  // 1 / the rows' sums, into ``inverse`` [16]
  void inverse_sums(float* inverse) const { (V16::all(1.0f) / l).store(inverse); }

  // where row i's query (and output) starts in [tokens, heads, dim], for kv head h
  int64_t at(const Chunk& c, int64_t h, int64_t i) const {
    return ((first + i) / c.group * c.num_heads + h * c.group + (first + i) % c.group) * c.head_dim;
  }
};

// The state of up to 16 query rows of one kv head: the row block and Q^T (pre-scaled)
struct Rows : RowBlock {
  float* qt;  // [dim, 16], rows past the chunk zero
};

void start_rows(const Chunk& c, int64_t h, int64_t first, float* qt, float* ot, Rows& s) {
  const int64_t dim = c.head_dim;
  s.qt = qt;
  s.begin(c, first, ot);
  std::fill(qt, qt + dim * kRows, 0.0f);
  const float factor = c.scale * kLog2e;
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t at = s.at(c, h, i);
    for (int64_t d = 0; d < dim; ++d)
      qt[d * kRows + i] = (c.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(c.query)[at + d])
                                  : static_cast<const float*>(c.query)[at + d]) * factor;
  }
}

// S^T of a block (``pt``) into P^T: the maxima moved, the exponentials taken, the sums and O^T rescaled
inline void softmax_block(Rows& s, float* pt, int64_t count, int64_t position, int64_t dim) {
  const V16 factor = s.advance(pt, count, position);
  V16 sum = V16::zero();
  for (int64_t j = 0; j < count; ++j) {
    const V16 p = exp2v(V16::load(pt + j * kRows) - s.m);
    p.store(pt + j * kRows);
    sum = sum + p;
  }
  s.rescale(factor, sum, position, dim);
}

// ``count`` consecutive keys at ``key`` / ``value``, the context's ``position``-th onwards, into B row blocks' states
// (``s[b]``; ``pt[b]``: scratch for its S^T and P^T). With AVX-512 the kernel attends the row blocks that see a key
// block two at a time (B = 2, 6 keys or head dims a tile): each key's and value's broadcast serves 32 rows and 12
// chains of FMAs are in flight. Every sum runs in the same order for any B: the same results, bit for bit.
template <int B>
void attend_blocks(const Chunk& c, Rows* const* s, const float* key, const float* value, int64_t stride,
                   int64_t count, int64_t position, float* const* pt, Ahead& ahead) {
  constexpr int64_t tile = B == 1 ? kTile : kPairTile;
  const int64_t dim = c.head_dim;
  const float* qt[B];
  float* at[B];
  for (int64_t j = 0; j < count; j += tile) {
    for (int b = 0; b < B; ++b) qt[b] = s[b]->qt, at[b] = pt[b] + j * kRows;
    scores_any<B>(static_cast<int>(std::min<int64_t>(tile, count - j)), key + j * stride, stride, qt, dim, at);
    ahead.step();
  }
  for (int b = 0; b < B; ++b) softmax_block(*s[b], pt[b], count, position, dim);
  for (int64_t d = 0; d < dim; d += tile) {
    for (int b = 0; b < B; ++b) at[b] = s[b]->ot + d * kRows;
    values_any<B>(static_cast<int>(std::min<int64_t>(tile, dim - d)), value + d, stride, pt, count, at);
    ahead.step();
  }
}

void finish_rows(const Chunk& c, int64_t h, const Rows& s) {
  const int64_t dim = c.head_dim;
  alignas(64) float inverse[kRows];
  s.inverse_sums(inverse);
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t at = s.at(c, h, i);
    if (c.bf16) {
      uint16_t* o = static_cast<uint16_t*>(c.out) + at;
      for (int64_t d = 0; d < dim; ++d) o[d] = f32_to_bf16(s.ot[d * kRows + i] * inverse[i]);
    } else {
      float* o = static_cast<float*>(c.out) + at;
      for (int64_t d = 0; d < dim; ++d) o[d] = s.ot[d * kRows + i] * inverse[i];
    }
  }
}

// how many of an item's row blocks (``rows``, either kernel's) see the key at ``position``
template <class RowBlocks>
int64_t seeing(const RowBlocks* rows, int64_t blocks, int64_t position) {
  int64_t n = 0;
  for (int64_t b = 0; b < blocks; ++b) n += position < rows[b].max_limit;
  return n;
}

// The tiles ``attend_blocks`` runs over a block of ``count`` keys for ``seeing`` row blocks (its ``step``s of Ahead):
// with AVX-512 the row blocks that see it are consecutive (their limits grow), so they go in pairs (kPairTile) and
// one alone when odd (kTile-wide); with AVX2 each alone
inline int64_t tiles(int64_t seeing, int64_t count, int64_t dim) {
  const int64_t single = ceil_div(count, kTile) + ceil_div(dim, kTile);
#if defined(__AVX512F__)
  return seeing / 2 * (ceil_div(count, kPairTile) + ceil_div(dim, kPairTile)) + seeing % 2 * single;
#else
  return seeing * single;
#endif
}
constexpr int64_t kGroup = 8;     // most row blocks of one kv head per item
constexpr int64_t kPackFrom = 4;  // fewest row blocks that a key block is packed for (fewer: read in place)

// One item: kv head ``h``, row blocks ``first_block`` .. + ``blocks`` (<= kGroup; row r is token r / group, query head
// h * group + r % group). Each block of keys and values is attended by all of the item's row blocks in turn, packed
// first (rows ``dim`` apart instead of the pool's ``slot_stride``) when the item has kPackFrom row blocks or more.
void run_rows(const Chunk& c, int64_t h, int64_t first_block, int64_t blocks) {
  const int64_t dim = c.head_dim, state = dim * kRows;
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>((2 * blocks * state) + 2 * kKeys * kRows + 2 * kKeys * dim + 16);
  if (scratch.size() < need) scratch.resize(need);
  float* base = scratch.data();
  base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;  // 64-byte aligned: a V16 a line
  float* pt = base + 2 * blocks * state;
  Rows rows[kGroup];
  float max_limit = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    start_rows(c, h, (first_block + b) * kRows, base + 2 * b * state, base + (2 * b + 1) * state, rows[b]);
    max_limit = std::max(max_limit, rows[b].max_limit);
  }
  int64_t position = 0;  // keys seen so far
  Ahead ahead;
  for (int64_t r = 0; r < c.num_runs && position < max_limit; ++r) {
    const int64_t slot0 = c.runs[2 * r], length = c.runs[2 * r + 1];
    for (int64_t start = 0; start < length && position < max_limit; start += kKeys) {
      const int64_t count = std::min(kKeys, length - start);
      const int64_t at = (slot0 + start) * c.slot_stride + h * dim;
      const int64_t steps = position + count < max_limit ? tiles(seeing(rows, blocks, position), count, dim) : 0;
      ahead.aim(c, h, r, start + kKeys, c.bf16 ? sizeof(uint16_t) : sizeof(float), steps);
      int64_t stride = c.slot_stride;
      const float* key;
      const float* value;
      float* packed = pt + 2 * kKeys * kRows;
      if (c.bf16) {  // always packed: widened to float32 once per block, for all of the item's row blocks
        const uint16_t* k16 = static_cast<const uint16_t*>(c.k) + at;
        const uint16_t* v16 = static_cast<const uint16_t*>(c.v) + at;
        for (int64_t j = 0; j < count; ++j) {
          widen(k16 + j * stride, dim, packed + j * dim);
          widen(v16 + j * stride, dim, packed + (kKeys + j) * dim);
        }
        key = packed;
        value = packed + kKeys * dim;
        stride = dim;
      } else {
        key = static_cast<const float*>(c.k) + at;
        value = static_cast<const float*>(c.v) + at;
        if (blocks >= kPackFrom) {
          for (int64_t j = 0; j < count; ++j) {
            std::copy(key + j * stride, key + j * stride + dim, packed + j * dim);
            std::copy(value + j * stride, value + j * stride + dim, packed + (kKeys + j) * dim);
          }
          key = packed;
          value = packed + kKeys * dim;
          stride = dim;
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        if (position >= rows[b].max_limit) continue;
        Rows* both[2] = {&rows[b], &rows[b + 1]};  // (the second only read when b + 1 < blocks)
        float* scratch_of[2] = {pt, pt + kKeys * kRows};
#if defined(__AVX512F__)
        if (b + 1 < blocks && position < rows[b + 1].max_limit) {
          attend_blocks<2>(c, both, key, value, stride, count, position, scratch_of, ahead);
          ++b;
          continue;
        }
#endif
        attend_blocks<1>(c, both, key, value, stride, count, position, scratch_of, ahead);
      }
      position += count;
    }
  }
  for (int64_t b = 0; b < blocks; ++b) finish_rows(c, h, rows[b]);
}

#endif

#if defined(PREFIXSERVE_VEC_PREFILL) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PREFIXSERVE_BF16_DOT 1
// bfloat16 on AVX512-BF16 (a Zen 4 EPYC, say; no AMX tiles): both products by vdpbf16ps, which multiplies pairs of
// bfloat16 values exactly and adds them into float32, 16 rows to a 512-bit vector, so the keys are never widened and
// each instruction does twice an FMA's work.
//
//   S^T = K Q^T     Q^T packed once per row block as bfloat16 pairs (head dims 2p, 2p+1 of each of the 16 rows); each
//                   key's pair broadcast straight from the pool, 16 keys at a time (8 for each of two row blocks);
//                   scores scaled by scale * log2(e)
//   softmax         as the float32 kernel, 16 rows per vector; P^T rounded to bfloat16 and interleaved by key pairs
//                   (the AMX kernel's rounding: the sums stay float32)
//   O^T += V^T P^T  values repacked once per block of 64 keys as pairs (key 2j, 2j+1 of each head dim); each pair
//                   broadcast, 16 head dims at a time (8 for each of two row blocks)
//
// A head size must be even. Same items, same blocks, same causal limits as the float32 kernel above.
namespace bf16dot {

constexpr int64_t kPairs = kKeys / 2;

// 2^t for the probabilities that are rounded to bfloat16 (8 bits of mantissa): a degree-4 polynomial fitted for the
// least largest relative error on |f| <= 1/2 (2.6e-6, against exp2_16's degree 6, 1.2e-7), and no clamp: a masked
// score's t of ~-1e30 scales to exactly 0, and the few between -149 and -126 give float32 subnormals, which the
// rounding to bfloat16 flushes to 0 (vcvtne2ps2bf16 treats them as zero) and which add nothing to a sum of at least 1
inline __m512 exp2_rounded(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.570099385216755e-3f);
  for (float c : {5.591786012171529e-2f, 2.4024744890245023e-1f, 6.931218147735553e-1f, 9.999992614269304e-1f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh pair_of(const uint16_t* at) {  // the 32 bits at ``at`` (two bfloat16) in every lane
  uint32_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// 16 rows of 16 words (``src``, rows ``src_stride`` words apart) into 16 rows of 16 (``dst``, ``dst_stride`` apart)
inline void transpose16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + i * dst_stride, r[i]);
}

struct Rows16 : RowBlock {
  uint32_t* qp;  // [dim / 2, 16] bfloat16 pairs, rows past the chunk zero
};

void start_rows(const Chunk& c, int64_t h, int64_t first, uint32_t* qp, float* ot, Rows16& s) {
  const int64_t dim = c.head_dim;
  s.qp = qp;
  s.begin(c, first, ot);
  std::fill(qp, qp + dim / 2 * kRows, 0u);
  for (int64_t i = 0; i < s.rows; ++i) {
    const uint16_t* q = static_cast<const uint16_t*>(c.query) + s.at(c, h, i);
    for (int64_t p = 0; p < dim / 2; ++p) std::memcpy(qp + p * kRows + i, q + 2 * p, sizeof(uint32_t));
  }
}

// S^T for N (<= 16) consecutive keys at ``key`` (pool rows ``stride`` apart) against B row blocks (``qp[b]`` into
// ``st[b]``), scaled by ``factor``: each key pair's broadcast serves all B
template <int N, int B>
inline void scores(const uint32_t* kt, const uint32_t* const* qp, int64_t dim, __m512 factor,
                   float* const* st) {
  __m512 acc[B][N];
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    __m512bh q[B];
    for (int b = 0; b < B; ++b) q[b] = (__m512bh)_mm512_loadu_si512(qp[b] + p * kRows);
    for (int n = 0; n < N; ++n) {
      const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(kt[p * kKeys + n]));
      for (int b = 0; b < B; ++b) acc[b][n] = _mm512_dpbf16_ps(acc[b][n], q[b], k);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) _mm512_store_ps(st[b] + n * kRows, _mm512_mul_ps(acc[b][n], factor));
}

// O^T[d .. d+N) += V^T P^T over ``pairs`` key pairs (``vp``: [pairs, dim] value pairs, ``pp[b]``: [pairs, 16] P pairs)
// for B row blocks (``ot[b]``)
template <int N, int B>
inline void values(const uint32_t* vp, int64_t dim, const uint32_t* const* pp, int64_t pairs, float* const* ot) {
  __m512 acc[B][N];
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) acc[b][n] = _mm512_load_ps(ot[b] + n * kRows);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh prob[B];
    for (int b = 0; b < B; ++b) prob[b] = (__m512bh)_mm512_load_si512(pp[b] + j * kRows);
    const uint32_t* v = vp + j * dim;
    for (int n = 0; n < N; ++n) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(v[n]));
      for (int b = 0; b < B; ++b) acc[b][n] = _mm512_dpbf16_ps(acc[b][n], prob[b], x);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) _mm512_store_ps(ot[b] + n * kRows, acc[b][n]);
}

template <int B>
void scores_any(int n, const uint32_t* key, const uint32_t* const* qp, int64_t dim, __m512 f,
                float* const* st) {
  switch (n) {
    case 16: scores<16, B>(key, qp, dim, f, st); break;
    case 8: scores<8, B>(key, qp, dim, f, st); break;
    case 7: scores<7, B>(key, qp, dim, f, st); break;
    case 6: scores<6, B>(key, qp, dim, f, st); break;
    case 5: scores<5, B>(key, qp, dim, f, st); break;
    case 4: scores<4, B>(key, qp, dim, f, st); break;
    case 3: scores<3, B>(key, qp, dim, f, st); break;
    case 2: scores<2, B>(key, qp, dim, f, st); break;
    default: scores<1, B>(key, qp, dim, f, st); break;
  }
}

template <int B>
void values_any(int n, const uint32_t* vp, int64_t dim, const uint32_t* const* pp, int64_t pairs, float* const* ot) {
  switch (n) {
    case 16: values<16, B>(vp, dim, pp, pairs, ot); break;
    case 8: values<8, B>(vp, dim, pp, pairs, ot); break;
    case 6: values<6, B>(vp, dim, pp, pairs, ot); break;
    case 4: values<4, B>(vp, dim, pp, pairs, ot); break;
    default: values<2, B>(vp, dim, pp, pairs, ot); break;  // head sizes are even
  }
}

// The next tile of ``left`` keys (or head dims): 16 side by side while 16 are left, else up to 8. A vdpbf16ps waits
// for the one before it on its accumulator (~6 cycles), and Zen 5's 512-bit units start two per cycle: 8 chains in
// flight keep them two-thirds busy at most (a loop of these alone: 328-345 GFLOP/s with 8, 484-500 with 12 or 16; this
// kernel alone, one thread: 283-291 with 8, 320-324 with 16). The float32 kernel's FMAs (4 cycles each) measured no
// faster with 16 keys a tile; it keeps 12 chains in flight by attending two row blocks at once (B = 2).
inline int64_t tile_of(int64_t left) { return left >= 16 ? 16 : std::min<int64_t>(8, left); }

// Keys (or head dims) a tile when two row blocks are attended at once (``attend_blocks<2>``): 8 x 2 = 16 chains
constexpr int64_t kPairTile = 8;

// As the float32 kernel's ``tiles``: pairs of row blocks take kPairTile-wide tiles, one alone ``tile_of``'s
inline int64_t tiles(int64_t seeing, int64_t count, int64_t dim) {
  const auto alone = [](int64_t left) {
    int64_t n = 0;
    for (; left > 0; left -= tile_of(left)) ++n;
    return n;
  };
  const int64_t pair = ceil_div(count, kPairTile) + ceil_div(dim, kPairTile);
  return seeing / 2 * pair + seeing % 2 * (alone(count) + alone(dim));
}

// One row block's softmax over a block of ``count`` keys: its S^T (``st``) hidden past the rows' limits, the maxima
// moved, the sums and O^T rescaled, and P^T rounded to bfloat16 into ``pp``, key pairs (2j, 2j+1) interleaved per row
// (the odd key of an odd count zero)
inline void probabilities(Rows16& s, float* st, uint32_t* pp, int64_t count, int64_t position, int64_t dim) {
  const V16 rescale = s.advance(st, count, position);
  const __m512 next = s.m.v;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 2) {
    const __m512 p0 = exp2_rounded(_mm512_sub_ps(_mm512_load_ps(st + j * kRows), next));
    const __m512 p1 = j + 1 < count ? exp2_rounded(_mm512_sub_ps(_mm512_load_ps(st + (j + 1) * kRows), next))
                                    : _mm512_setzero_ps();
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 of the 16 rows, p1 of the 16 rows]
    _mm512_store_si512(pp + j / 2 * kRows, _mm512_permutexvar_epi16(interleave, both));
  }
  s.rescale(rescale, V16{sum}, position, dim);
}

// ``count`` keys at ``key`` (pool rows ``stride`` apart) and their values as pairs ``vp``, the context's
// ``position``-th onwards, into B row blocks' states (``s[b]``; ``st[b]``: scratch for S^T, ``pp[b]``: for P^T pairs).
// B = 2 (the row blocks that see a key block, two at a time): each key's and value's pair is broadcast once for 32
// rows, 8 keys or head dims a tile (16 chains in flight, as B = 1's 16-wide tiles); every sum runs in the same order
// for any B, so the output is the same bits. The kernel alone, one thread, 64 new tokens after 2048 cached:
// 328-334 -> 361-369 GFLOP/s (Zen 5, interleaved).
template <int B>
void attend_blocks(const Chunk& c, Rows16* const* s, const uint32_t* key, int64_t stride, const uint32_t* vp,
                   int64_t count, int64_t position, float* const* st, uint32_t* const* pp, Ahead& ahead) {
  const int64_t dim = c.head_dim;
  const __m512 factor = _mm512_set1_ps(c.scale * kLog2e);
  const uint32_t* qp[B];
  float* at[B];
  for (int b = 0; b < B; ++b) qp[b] = s[b]->qp;
  for (int64_t j = 0, n = 0; j < count; j += n) {
    n = B == 1 ? tile_of(count - j) : std::min(kPairTile, count - j);
    for (int b = 0; b < B; ++b) at[b] = st[b] + j * kRows;
    scores_any<B>(static_cast<int>(n), key + j, qp, dim, factor, at);
    ahead.step();
  }
  for (int b = 0; b < B; ++b) probabilities(*s[b], st[b], pp[b], count, position, dim);
  const int64_t pairs = (count + 1) / 2;
  for (int64_t d = 0, n = 0; d < dim; d += n) {
    n = B == 1 ? tile_of(dim - d) : std::min(kPairTile, dim - d);  // even: head sizes are
    for (int b = 0; b < B; ++b) at[b] = s[b]->ot + d * kRows;
    values_any<B>(static_cast<int>(n), vp + d, dim, pp, pairs, at);
    ahead.step();
  }
}

void finish_rows(const Chunk& c, int64_t h, const Rows16& s) {
  const int64_t dim = c.head_dim;
  alignas(64) float inverse[kRows];
  s.inverse_sums(inverse);
  for (int64_t i = 0; i < s.rows; ++i) {
    uint16_t* o = static_cast<uint16_t*>(c.out) + s.at(c, h, i);
    for (int64_t d = 0; d < dim; ++d) o[d] = f32_to_bf16(s.ot[d * kRows + i] * inverse[i]);
  }
}

// One item, as ``run_rows``: kv head ``h``, row blocks ``first_block`` .. + ``blocks``; each block of values is
// repacked as pairs once for all of them, the keys are read in place
void run_rows(const Chunk& c, int64_t h, int64_t first_block, int64_t blocks) {
  const int64_t dim = c.head_dim;
  const int64_t q_words = dim / 2 * kRows, o_floats = dim * kRows;
  thread_local std::vector<uint32_t> scratch;  // 32-bit words: Q pairs, O^T, S^T, P pairs, value pairs
  const size_t need = static_cast<size_t>(blocks * (q_words + o_floats) + 2 * kKeys * kRows + 2 * kPairs * kRows +
                                          kPairs * dim + 16);
  if (scratch.size() < need) scratch.resize(need);
  uint32_t* base = scratch.data();
  base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(uint32_t)) % 16) % 16;  // 64-byte aligned
  float* st = reinterpret_cast<float*>(base + blocks * (q_words + o_floats));
  uint32_t* pp = base + blocks * (q_words + o_floats) + 2 * kKeys * kRows;
  uint32_t* vp = pp + 2 * kPairs * kRows;
  float* st_of[2] = {st, st + kKeys * kRows};
  uint32_t* pp_of[2] = {pp, pp + kPairs * kRows};
  Rows16 rows[kGroup];
  float max_limit = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* at = base + b * (q_words + o_floats);
    start_rows(c, h, (first_block + b) * kRows, at, reinterpret_cast<float*>(at + q_words), rows[b]);
    max_limit = std::max(max_limit, rows[b].max_limit);
  }
  const uint16_t* k16 = static_cast<const uint16_t*>(c.k);
  const uint16_t* v16 = static_cast<const uint16_t*>(c.v);
  int64_t position = 0;
  Ahead ahead;
  for (int64_t r = 0; r < c.num_runs && position < max_limit; ++r) {
    const int64_t slot0 = c.runs[2 * r], length = c.runs[2 * r + 1];
    for (int64_t start = 0; start < length && position < max_limit; start += kKeys) {
      const int64_t count = std::min(kKeys, length - start);
      const int64_t at = (slot0 + start) * c.slot_stride + h * dim;
      const int64_t steps = position + count < max_limit ? tiles(seeing(rows, blocks, position), count, dim) : 0;
      ahead.aim(c, h, r, start + kKeys, sizeof(uint16_t), steps);
      for (int64_t j = 0; j < count; j += 2) {  // value pairs: (key j, key j + 1) of each head dim
        const uint16_t* v0 = v16 + at + j * c.slot_stride;
        const uint16_t* v1 = j + 1 < count ? v0 + c.slot_stride : nullptr;
        uint32_t* to = vp + j / 2 * dim;
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) {
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
          const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)))
                                : _mm512_setzero_si512();
          _mm512_storeu_si512(to + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (; d < dim; ++d) to[d] = v0[d] | (v1 ? static_cast<uint32_t>(v1[d]) << 16 : 0u);
      }
      thread_local std::vector<uint32_t> ktbuf;
      if (ktbuf.size() < static_cast<size_t>(kKeys * dim / 2 + 16)) ktbuf.resize(kKeys * dim / 2 + 16);
      uint32_t* kt = ktbuf.data();
      kt += (16 - (reinterpret_cast<uintptr_t>(kt) / 4) % 16) % 16;
      if (count % 16 == 0 && (dim / 2) % 16 == 0) {
        for (int64_t g = 0; g < count; g += 16)
          for (int64_t h = 0; h < dim / 2; h += 16)
            transpose16(reinterpret_cast<const uint32_t*>(k16 + at + g * c.slot_stride) + h, c.slot_stride / 2,
                        kt + h * kKeys + g, kKeys);
      } else {
        for (int64_t j = 0; j < count; ++j) {
          const uint32_t* row = reinterpret_cast<const uint32_t*>(k16 + at + j * c.slot_stride);
          for (int64_t p = 0; p < dim / 2; ++p) kt[p * kKeys + j] = row[p];
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        if (position >= rows[b].max_limit) continue;
        Rows16* both[2] = {&rows[b], &rows[b + 1]};  // (the second only read when b + 1 < blocks)
        if (b + 1 < blocks && position < rows[b + 1].max_limit) {
          attend_blocks<2>(c, both, kt, c.slot_stride, vp, count, position, st_of, pp_of, ahead);
          ++b;
          continue;
        }
        attend_blocks<1>(c, both, kt, c.slot_stride, vp, count, position, st_of, pp_of, ahead);
      }
      position += count;
    }
  }
  for (int64_t b = 0; b < blocks; ++b) finish_rows(c, h, rows[b]);
}

}  // namespace bf16dot
#endif

bool has_bf16_dot() {
#ifdef PREFIXSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool has_vector_prefill() {
#ifdef PREFIXSERVE_VEC_PREFILL
  return true;
#else
  return false;
#endif
}

// query / out [tokens, heads, dim], contiguous; k_cache / v_cache [slots, kv_heads, dim], contiguous (a layer's pool),
// all float32 or all bfloat16 (computed in float32: CPUs without AMX tiles); runs [R, 2] int64: (first slot, length) of
// the context's runs in order, the chunk's own tokens being the last ``tokens`` keys. dim <= 256.
void prefill_attention_f32(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& runs, double scale, at::Tensor& out, bool bf16_dot) {
  TORCH_CHECK(has_vector_prefill(), "prefill_attention_f32: built without AVX2 and FMA");
#ifdef PREFIXSERVE_VEC_PREFILL
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && out.sizes() == query.sizes() &&
                  v_cache.sizes() == k_cache.sizes(), "prefill_attention_f32: bad shapes");
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &k_cache, &v_cache, &out})
    TORCH_CHECK(t->scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat) && t->is_contiguous(),
                "prefill_attention_f32: contiguous float32 or bfloat16 only, all of one dtype");
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_slots = k_cache.size(0), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0,
              "prefill_attention_f32: head mismatch");
  TORCH_CHECK(head_dim > 0 && head_dim <= kMaxDim, "prefill_attention_f32: head size up to 256 only");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 2 && runs.is_contiguous(),
              "prefill_attention_f32: runs must be [R, 2] int64");
  const int64_t* run = runs.data_ptr<int64_t>();
  int64_t length = 0;
  for (int64_t r = 0; r < runs.size(0); ++r) {  // bounds: a bad plan must not read outside the pool
    TORCH_CHECK(run[2 * r] >= 0 && run[2 * r + 1] >= 0 && run[2 * r + 1] <= num_slots - run[2 * r],
                "prefill_attention_f32: run outside the pool");
    length += run[2 * r + 1];
  }
  TORCH_CHECK(tokens > 0 && length >= tokens, "prefill_attention_f32: the runs must end with the chunk's own tokens");
  const int64_t group = num_heads / num_kv_heads;
  const bool dot = bf16 && bf16_dot && has_bf16_dot() && head_dim % 2 == 0;
  const Chunk chunk{query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), run, runs.size(0),
                    num_heads, group, tokens * group, head_dim, num_kv_heads * head_dim, length - tokens,
                    static_cast<float>(scale), bf16};
  // items: (kv head, up to kGroup row blocks), as many row blocks per item as still leaves every thread an item, and
  // a kv head's row blocks shared evenly among its items (12 as 6 + 6, not 8 + 4: with 3 kv heads on 2 threads, one
  // thread had 20 row blocks to attend and the other 16)
  const int64_t row_blocks = ceil_div(chunk.num_rows, kRows), threads = at::get_num_threads();
  const auto even = [row_blocks](int64_t most) { return ceil_div(row_blocks, ceil_div(row_blocks, most)); };
  int64_t per_item = even(std::min(kGroup, row_blocks));
  while (per_item > 1 && num_kv_heads * ceil_div(row_blocks, per_item) < threads) per_item = even((per_item + 1) / 2);
  const int64_t groups = ceil_div(row_blocks, per_item);
  at::parallel_for(0, num_kv_heads * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = (item % groups) * per_item;
#ifdef PREFIXSERVE_BF16_DOT
      if (dot) {
        bf16dot::run_rows(chunk, item / groups, first, std::min(per_item, row_blocks - first));
        continue;
      }
#endif
      run_rows(chunk, item / groups, first, std::min(per_item, row_blocks - first));
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) {
  m.def("has_vector_prefill() -> bool", &has_vector_prefill);
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("prefill_attention_f32(Tensor query, Tensor k_cache, Tensor v_cache, Tensor runs, float scale, "
        "Tensor(a!) out, bool bf16_dot=True) -> ()");
}

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) { m.impl("prefill_attention_f32", &prefill_attention_f32); }
