// Linear layers with few input rows (decode batches, short prompts), float32 and bfloat16: see replica/cpu_kernels.py.
//
// y[M, N] = x[M, K] . w[N, K]^T (+ bias), with w in its own [out, in] layout: nothing is packed or copied, so the
// weights are stored once. For a handful of rows the product is bound by streaming the weights, and each weight row
// is read from memory once: a block of 4 weight rows is dotted against up to 4 input rows at a time (4 x 4 running
// sums of 16 floats, which stay in AVX-512's 32 registers; 3 x 4 sums of 8 floats in AVX2's 16), then the sums are
// reduced; further input rows reuse the block from L1.
// bfloat16 weights are widened to float32 as they are loaded, and the sums are rounded once to the output dtype.
// MKL's float32 GEMM packs the weight matrix on every call, and oneDNN's bfloat16 GEMM spends as long setting up its
// call and tiles: with 1-16 rows, either costs more than streaming the weights once.
//
// On AVX-512 a second copy of the weights in pair layout (pack_pairs, below) serves 1-16 rows faster still.
// Larger inputs, other dtypes, and shapes the tiles do not cover go to at::linear unchanged. The prefetch of the
// next block may name addresses past the last weight row; a prefetch never faults.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "reduce16.h"
#include "step_helper.h"

namespace {

constexpr int64_t kMaxFloatRows = 16;
constexpr int64_t kMaxBFloat16Rows = 8;

// The tile is sized to the register file: its MT x NT running sums and NT weight vectors must stay in registers, or
// every multiply-add also spills and reloads (on AVX2, tiles sized for AVX-512 ran 4-6x slower than MKL at 4-16 rows).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;    // one zmm register per vector; 32 of them
constexpr int kRowTile = 4;       // 4 x 4 sums + 4 weight vectors + 1 input vector = 21 registers
#else
constexpr int64_t kLanes = 8;     // AVX2: one ymm register per vector; 16 of them
constexpr int kRowTile = 3;       // 3 x 4 sums + 4 weight vectors = 16 registers (the input vector is an operand
                                  // of the multiply-add; 2 rows measured the same or slower, benchmarks/linear_rows.py)
#endif
constexpr int kColTile = 4;

typedef float vec __attribute__((vector_size(kLanes * 4), aligned(4)));  // unaligned loads of kLanes floats
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

inline float reduce4(vec4 b) { return (b[0] + b[2]) + (b[1] + b[3]); }

#if defined(__AVX512F__)
inline float reduce(vec v) {
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return reduce4(__builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7));
}
#else
inline float reduce(vec v) {
  return reduce4(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
#endif

typedef uint16_t bits16 __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint32_t bits32 __attribute__((vector_size(kLanes * 4)));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }

inline vec load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32: widen and shift
  const bits32 wide = __builtin_convertvector(*reinterpret_cast<const bits16*>(p), bits32) << 16;
  return reinterpret_cast<const vec&>(wide);
}

// Rows [0, MT) of x against the NT weight rows from n: y[m, n + j], K a multiple of kLanes.
template <int MT, int NT, bool PREFETCH, typename W>
__attribute__((noinline)) void tile(const float* x, const W* w, const float* bias, W* y, int64_t K, int64_t N,
                                    int64_t n) {
  vec acc[MT][NT];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[m][j] = vec{};
  const W* rows = w + n * K;
  for (int64_t k = 0; k < K; k += kLanes) {
    vec wv[NT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) wv[j] = load(rows + j * K + k);
    if (PREFETCH) {  // the next block's rows, at the same offset: keeps more memory reads in flight
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) __builtin_prefetch(rows + (NT + j) * K + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) {
      const vec xv = load(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) y[m * N + n + j] = W(reduce(acc[m][j]) + (bias ? bias[n + j] : 0.0f));
}

// ``rows`` (1..kRowTile) rows of x against NT weight rows: the tile of that height.
template <int NT, bool PREFETCH, typename W>
inline void rows_tile(int64_t rows, const float* x, const W* w, const float* bias, W* y, int64_t K, int64_t N,
                      int64_t n) {
  if constexpr (kRowTile >= 4) {
    if (rows == 4) return tile<4, NT, PREFETCH, W>(x, w, bias, y, K, N, n);
  }
  if constexpr (kRowTile >= 3) {
    if (rows == 3) return tile<3, NT, PREFETCH, W>(x, w, bias, y, K, N, n);
  }
  if (rows == 2) return tile<2, NT, PREFETCH, W>(x, w, bias, y, K, N, n);
  tile<1, NT, PREFETCH, W>(x, w, bias, y, K, N, n);
}

// Every row of x against NT weight rows at a time: a block of weight rows comes from memory once, and the row tiles
// after the first read it from L1.
template <int NT, typename W>
inline void block(const float* x, const W* w, const float* bias, W* y, int64_t M, int64_t K, int64_t N,
                  int64_t n) {
  // the first tile reads the block from memory (and asks for the next one); the others find it in L1
  const int64_t first = M >= kRowTile ? kRowTile : M;
  rows_tile<NT, true, W>(first, x, w, bias, y, K, N, n);
  for (int64_t m = first; m < M; m += kRowTile) {
    const int64_t rows = M - m >= kRowTile ? kRowTile : M - m;
    rows_tile<NT, false, W>(rows, x + m * K, w, bias, y + m * N, K, N, n);
  }
}

template <typename W>
void small_rows(const float* x, const W* w, const float* bias, W* y, int64_t M, int64_t K, int64_t N,
                int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kColTile <= n_end; n += kColTile) block<kColTile, W>(x, w, bias, y, M, K, N, n);
  for (; n < n_end; ++n) block<1, W>(x, w, bias, y, M, K, N, n);
}

#if defined(__AVX512F__)
// 1..kStreamRows input rows (a decode step of 1-3 requests) on AVX-512: the weight rows are read one after another,
// each whole (so memory is read in order and the hardware prefetcher streams it), dotted with the input rows from L1
// (bfloat16: as bfloat16 pairs by vdpbf16ps where the CPU has AVX512-BF16, no widening); the sums of 16 weight rows
// are reduced together (``reduce16``: 4 rounds of shuffle + add for 16 outputs). The tiles above read 4 weight rows
// side by side, 1 KiB apart; on a Zen 4 core they streamed a bfloat16 step's weights at ~11 GB/s, where one thread
// reads memory at ~22 (benchmarks/linear_rows.py, 1 row, 1 thread: 4.35 -> 2.78 ms bfloat16, 6.60 -> 5.12 float32).
// At 4 rows oneDNN's packed GEMM was level or faster (replica/llama.py sends 4+ rows there). Where a model also
// holds its weights in pair layout (below), that kernel takes 2+ float32 rows, and bfloat16 rows, first.
constexpr int kStreamRows = 3;

using prefixserve::kKeyOf;
using prefixserve::reduce16;

// one weight row against the M input rows: lane-wise partial sums (two chains each, summed)
template <int M>
inline void dot_row(const float* x, const float* w, int64_t K, __m512* out) {
  __m512 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    for (int m = 0; m < M; ++m) {
      a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, a[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(a[m][0], a[m][1]);
}

#if defined(__AVX512BF16__)
template <int M>
inline void dot_row(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, __m512* out) {
  __m512 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int m = 0; m < M; ++m) {
      a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)_mm512_loadu_si512(x + m * K + k), w0);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), w1);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(a[m][0], a[m][1]);
}
#endif

inline void store16(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }

inline void store16(c10::BFloat16* y, __m512 v, __mmask16 mask) {  // rounded to nearest even, as c10's conversion
  alignas(64) float wide[16];
  _mm512_store_ps(wide, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) y[i] = c10::BFloat16(wide[i]);
}

// y[m, n_begin .. n_end) for the M input rows (x and w of one dtype; K a multiple of 64)
template <int M, typename T>
void stream_rows(const T* x, const T* w, const float* bias, T* y, int64_t K, int64_t N, int64_t n_begin,
                 int64_t n_end) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, n_end - n0));
    __m512 parts[M][16];
    for (int t = 0; t < 16; ++t) {
      __m512 sums[M];
      if (t < count) {
        dot_row<M>(x, w + (n0 + t) * K, K, sums);
      } else {
        for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
      }
      for (int m = 0; m < M; ++m) parts[m][kKeyOf[t]] = sums[m];
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store16(y + m * N + n0, _mm512_add_ps(reduce16(parts[m]), b), mask);
  }
}

template <typename T>
constexpr bool kStreams = std::is_same_v<T, float>
#if defined(__AVX512BF16__)
                          || std::is_same_v<T, c10::BFloat16>
#endif
    ;
#endif

// float32 copies of a bfloat16 input and bias (M x K and N values), in a buffer each thread keeps
inline const float* as_float(const float* p, int64_t, std::vector<float>&) { return p; }

inline const float* as_float(const c10::BFloat16* p, int64_t n, std::vector<float>& buffer) {
  buffer.resize(n);
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(p[i]);
  return buffer.data();
}

#if defined(__AVX512F__)
// Weights in pair layout, for 1..kMaxPairRows input rows (decode batches, short prompts) on AVX-512: bfloat16 where
// the CPU has AVX512-BF16, float32 on any AVX-512 CPU. pack_pairs reorders w [N, K] once into blocks of kPairCols
// output columns, each block contiguous, in 4-byte units of E = 4 / sizeof(T) consecutive inputs (bfloat16: a pair,
// float32: one):
//
//   pairs[block][k / E][column][k % E]      (zero past the last column)
//
// so that one 64-byte load holds 16 columns' weights for one unit, and one multiply-add (vdpbf16ps, vfmadd231ps)
// takes them with one input row's unit broadcast to every lane: each lane keeps the running sum of one output, with no
// horizontal reduction at the end, and every weight is read from memory once, in order, for all the rows together;
// the M x 2 sums stay in registers. On the Zen 4 box, one thread (benchmarks/linear_rows.py, the tiny Llama's layers;
// BENCHMARKS.md 0n): bfloat16 2.07-2.83 ms for 1-8 rows, where the streaming kernel above took 2.62-3.25 ms for 1-3
// rows and oneDNN's packed GEMM 3.31-4.38 ms for 4-8. From ~8 rows the multiply-adds, not memory, bound it there. Up
// to kPairPass rows take one pass over each block (2 x 12 sums, the block's two vectors and the broadcast input: 27 of
// the 32 registers); 13-16 rows run as 12 rows and the rest, the block read again from cache. On the Zen 5 box, whose
// 512-bit units do twice Zen 4's multiply-adds a cycle, one pass took 9-12 bfloat16 rows in 1.48-2.02 ms where 8 + the
// rest took 2.55-2.64 (oneDNN's packed GEMM 2.3-2.7; BENCHMARKS.md 0zd). float32 (BENCHMARKS.md 0ze): the streaming
// kernel read 3 rows' weights three times over there, and oneDNN's GEMM ran 4-16 rows at 3.7-5.7 ms, where one
// thread streams the float32 weights in ~2.3.
constexpr int64_t kPairCols = 32;
constexpr int64_t kMaxPairRows = 16;
constexpr int kPairPass = 12;
// With the step helper sharing the step (step_helper.h), inputs of more than kMaxPairRows rows, up to
// kMaxSharedPairRows, run the pair kernel too: each block of columns takes the rows in groups of at most kPairPass,
// balanced (24 rows: 12 + 12; 32: 11 + 11 + 10), one pass each, the block read again from cache for every group after
// the first. One thread's oneDNN GEMM is the path there otherwise (the caller's `pairs_below_rows`).
constexpr int64_t kMaxSharedPairRows = 64;
// Passes of more than 8 rows are bound by their multiply-adds about as much as by memory, and the hardware prefetcher
// fell behind there: they ask for the block's weights kPairPrefetch units ahead themselves (2 KiB; past the block's
// end a prefetch only names an address). 12 rows, one thread (benchmarks/linear_rows.py, Zen 5): float32 3.8-4.2 ms
// against 4.9-5.2 without, bfloat16 1.75-1.83 against 1.91-1.95; 2-8 rows were level or slower with it.
constexpr int64_t kPairPrefetch = 16;

// One float32 row runs on the weight's own layout instead (stream_rows): 2.17-2.21 ms against the pair kernel's
// 2.30-2.46 on the Zen 5 box (benchmarks/linear_rows.py, one thread), where 2 rows already took 2.60 against 2.88.
inline int64_t pair_from_rows(at::ScalarType dtype) { return dtype == at::kFloat ? 2 : 1; }

template <typename T>
constexpr bool kPairKernel = std::is_same_v<T, float>
#if defined(__AVX512BF16__)
                             || std::is_same_v<T, c10::BFloat16>
#endif
    ;

at::Tensor pack_pairs(const at::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || (bf16 && weight.size(1) % 2 == 0)),
              "pack_pairs takes a 2-D float32 weight, or a bfloat16 one with an even number of columns");
  const at::Tensor w = weight.contiguous();
  const int64_t E = bf16 ? 2 : 1, N = w.size(0), Ku = w.size(1) / E, blocks = (N + kPairCols - 1) / kPairCols;
  at::Tensor out = at::zeros({blocks, Ku, kPairCols, E}, w.options());
  const uint32_t* src = static_cast<const uint32_t*>(w.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kPairCols && b * kPairCols + c < N; ++c) {
        const uint32_t* row = src + (b * kPairCols + c) * Ku;
        for (int64_t k = 0; k < Ku; ++k) dst[(b * Ku + k) * kPairCols + c] = row[k];
      }
  });
  return out;
}

// sum += x's unit (broadcast) times 16 columns' weights of one unit
inline __m512 pair_madd(float, __m512 sum, uint32_t x, __m512i w) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x))), _mm512_castsi512_ps(w), sum);
}
inline void pair_store(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
#if defined(__AVX512BF16__)
inline __m512 pair_madd(c10::BFloat16, __m512 sum, uint32_t x, __m512i w) {
  return _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)), (__m512bh)w);
}
inline void pair_store(c10::BFloat16* y, __mmask16 mask, __m512 v) {  // rounded to nearest even, as c10's conversion
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// M input rows (Ku units each) against the NV 16-column vectors of one block, stored to y[:, n0 .. n0 + kPairCols)
template <int M, typename T>
inline void pair_block(const uint32_t* x, int64_t Ku, const uint32_t* block, const float* bias, T* y, int64_t N,
                       int64_t n0) {
  constexpr int NV = kPairCols / 16;
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Ku; ++k) {
    if constexpr (M > 8) {  // see kPairPrefetch
      _mm_prefetch(reinterpret_cast<const char*>(block + (k + kPairPrefetch) * kPairCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + (k + kPairPrefetch) * kPairCols + 16), _MM_HINT_T0);
    }
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(block + k * kPairCols + v * 16);
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = pair_madd(T(), acc[m][v], x[m * Ku + k], wv[v]);
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c = n0 + v * 16;
    if (c >= N) break;
    const int64_t count = std::min<int64_t>(16, N - c);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) pair_store(y + m * N + c, mask, _mm512_add_ps(acc[m][v], b));
  }
}

template <int M, typename T>
void pair_rows(const uint32_t* x, int64_t Ku, const uint32_t* pairs, const float* bias, T* y, int64_t N,
               int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const uint32_t* block = pairs + b * Ku * kPairCols;
    if constexpr (M <= kPairPass) {
      pair_block<M>(x, Ku, block, bias, y, N, b * kPairCols);
    } else {  // rows kPairPass.. read the block again, from cache
      pair_block<kPairPass>(x, Ku, block, bias, y, N, b * kPairCols);
      pair_block<M - kPairPass>(x + kPairPass * Ku, Ku, block, bias, y + kPairPass * N, N, b * kPairCols);
    }
  }
}

template <typename T, int... Ms>
void pair_dispatch(std::integer_sequence<int, Ms...>, int64_t M, const uint32_t* x, int64_t Ku,
                   const uint32_t* pairs, const float* bias, T* y, int64_t N, int64_t begin, int64_t end) {
  ((M == Ms + 1 ? pair_rows<Ms + 1>(x, Ku, pairs, bias, y, N, begin, end) : void()), ...);
}

bool pair_covered(const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  const bool kernel = dtype == at::kFloat ? kPairKernel<float> : dtype == at::kBFloat16 && kPairKernel<c10::BFloat16>;
  const int64_t E = dtype == at::kBFloat16 ? 2 : 1;
  return kernel && pairs.scalar_type() == dtype && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 &&
         x.size(0) <= kMaxSharedPairRows && pairs.dim() == 4 && pairs.is_contiguous() && pairs.size(3) == E &&
         x.size(1) == E * pairs.size(1) && pairs.size(2) == kPairCols && weight.dim() == 2 &&
         weight.size(1) == x.size(1) && pairs.size(0) == (weight.size(0) + kPairCols - 1) / kPairCols &&
         (!bias.has_value() || !bias->defined() ||
          (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == weight.size(0)));
}

template <typename T>
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), Ku = pairs.size(1), N = weight.size(0);
  thread_local std::vector<float> bias_buffer;  // (pair_covered: a bias is contiguous, N values)
  const float* bp = (bias.has_value() && bias->defined()) ? as_float(bias->data_ptr<T>(), N, bias_buffer) : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  const uint32_t* xp = static_cast<const uint32_t*>(x.data_ptr());
  const uint32_t* wp = static_cast<const uint32_t*>(pairs.data_ptr());
  T* yp = y.data_ptr<T>();
  const int64_t blocks = pairs.size(0);
  constexpr auto kRowCounts = std::make_integer_sequence<int, kMaxPairRows>{};
  const int64_t groups = M <= kMaxPairRows ? 1 : (M + kPairPass - 1) / kPairPass;  // kMaxSharedPairRows: see there
  auto columns = [&](int64_t begin, int64_t end) {
    if (groups == 1) {
      pair_dispatch<T>(kRowCounts, M, xp, Ku, wp, bp, yp, N, begin, end);
      return;
    }
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t m1 = M * (g + 1) / groups;
        pair_dispatch<T>(kRowCounts, m1 - m0, xp + m0 * Ku, Ku, wp, bp, yp + m0 * N, N, b, b + 1);
        m0 = m1;
      }
    }
  };
  // with the step helper: chunks of 1-2 blocks (32-64 columns), taken by whichever thread is free; on OpenMP's
  // threads, 8 blocks per task at least (K = 512: 256 KiB of bfloat16 weights) to amortise the thread hand-off
  prefixserve::share_or_parallel_for(blocks, blocks >= 64 ? 2 : 1, 8, columns);
  return y;
}

// Rows up to which the pair kernel takes an input while the step helper shares the step
int64_t max_shared_pair_rows() { return kMaxSharedPairRows; }
#endif

// The step helper (step_helper.h): armed for the steps the engine picks, it shares the pair kernel's short steps
void arm_step_helper(bool on) { prefixserve::StepHelper::instance().arm(on); }
int64_t step_helper_chunks() { return prefixserve::StepHelper::instance().chunks_taken(); }
bool step_helper_armed() { return prefixserve::StepHelper::instance().armed(); }

// Whether pack_pairs and the pair-layout kernel exist for float32 (AVX-512) or bfloat16 (AVX512-BF16) weights
bool has_pair_linear(bool float32) {
#if defined(__AVX512F__)
  return float32 ? kPairKernel<float> : kPairKernel<c10::BFloat16>;
#else
  return false;
#endif
}

// Rows the kernel takes per dtype: above them the library's GEMM is faster (benchmarks/linear_rows.py): MKL's
// packing pays for itself from ~16 float32 rows, oneDNN's AMX GEMM (on weights it has not packed) from ~12 bfloat16
// rows.
int64_t max_rows(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kMaxFloatRows;
    case at::kBFloat16: return kMaxBFloat16Rows;
    default: return 0;
  }
}

bool covered(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (x.scalar_type() != weight.scalar_type() || x.dim() != 2 || weight.dim() != 2) return false;
  if (!x.is_contiguous() || !weight.is_contiguous() || x.size(1) != weight.size(1)) return false;
  if (x.size(0) < 1 || x.size(0) > max_rows(x.scalar_type()) || x.size(1) % kLanes != 0) return false;
  if (bias.has_value() && bias->defined() &&
      (bias->scalar_type() != x.scalar_type() || !bias->is_contiguous() || bias->numel() != weight.size(0)))
    return false;
  return true;
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  thread_local std::vector<float> x_buffer, bias_buffer;
  const float* bp = (bias.has_value() && bias->defined()) ? as_float(bias->data_ptr<T>(), N, bias_buffer) : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* yp = y.data_ptr<T>();  // sums rounded to T once (bfloat16: to nearest even, as oneDNN rounds its float32 sums)
#if defined(__AVX512F__)
  if constexpr (kStreams<T>) {
    if (M <= kStreamRows && K % 64 == 0) {
      const T* xt = x.data_ptr<T>();
      at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
        switch (M) {
          case 1: stream_rows<1, T>(xt, wp, bp, yp, K, N, begin, end); break;
          case 2: stream_rows<2, T>(xt, wp, bp, yp, K, N, begin, end); break;
          default: stream_rows<3, T>(xt, wp, bp, yp, K, N, begin, end); break;
        }
      });
      return;
    }
  }
#endif
  const float* xp = as_float(x.data_ptr<T>(), M * K, x_buffer);  // the tiles read float32 inputs
  // whole tiles of weight rows per task; a task of at least 256 rows amortises the thread hand-off
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) { small_rows<T>(xp, wp, bp, yp, M, K, N, begin, end); });
}

// oneDNN's GEMM on a weight packed once by mkldnn::_reorder_linear_weight (an opaque mkldnn tensor): the path of
// inductor's frozen graphs, reached here with the weight as an ordinary graph input. Called through the dispatcher,
// boxed, since ATen declares the op only in its registration.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x.contiguous());
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() && bias->defined() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [M, K] . weight^T: with weights in pair layout, the pair kernel for the rows it takes (pair_from_rows up to
// pairs_below_rows); else with a packed weight, oneDNN's packed GEMM from packed_from_rows rows up; below that (or
// with none) the kernel where it covers the input, else ATen.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool use_kernel,
                  const c10::optional<at::Tensor>& packed, int64_t packed_from_rows,
                  const c10::optional<at::Tensor>& pairs, int64_t pairs_below_rows) {
#if defined(__AVX512F__)
  if (pairs.has_value() && pairs->defined() && pair_covered(x, *pairs, weight, bias) &&
      x.size(0) >= pair_from_rows(x.scalar_type()) &&
      (x.size(0) < pairs_below_rows ||
       (pairs_below_rows > 0 && x.size(0) > kMaxPairRows && prefixserve::helper_shares_step()))) {
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16) return pair_linear<c10::BFloat16>(x, *pairs, weight, bias);
#endif
    return pair_linear<float>(x, *pairs, weight, bias);
  }
#endif
  if (packed.has_value() && packed->defined() && x.dim() == 2 && x.size(0) >= packed_from_rows)
    return packed_linear(x, *packed, bias);
  if (!use_kernel || !covered(x, weight, bias)) return at::linear(x, weight, bias);
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat)
    run<float>(x, weight, bias, y);
  else
    run<c10::BFloat16>(x, weight, bias, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, bool use_kernel=True, Tensor? packed=None, "
        "int packed_from_rows=0, Tensor? pairs=None, int pairs_below_rows=0) -> Tensor");
  m.def("has_pair_linear(bool float32=False) -> bool", &has_pair_linear);
  m.def("arm_step_helper(bool on) -> ()", &arm_step_helper);
  m.def("step_helper_chunks() -> int", &step_helper_chunks);
  m.def("step_helper_armed() -> bool", &step_helper_armed);
#if defined(__AVX512F__)
  m.def("max_shared_pair_rows() -> int", &max_shared_pair_rows);
  m.def("pack_pairs(Tensor weight) -> Tensor", &pack_pairs);
#endif
}

// MkldnnCPU too: a packed weight argument puts that key in the call's dispatch key set
TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) { m.impl("linear", &linear); }
TORCH_LIBRARY_IMPL(prefixserve_cpu, MkldnnCPU, m) { m.impl("linear", &linear); }
