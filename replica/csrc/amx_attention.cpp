// Prefill attention on Intel AMX tiles (bfloat16): one prompt chunk's query tokens against their whole context, the
// cached part and the chunk's own tokens (causal), wherever its pages lie in the pool. See replica/cpu_kernels.py
// (``prefill_attention``).
//
// Before it, a chunk's context was attended run by run by ATen's CPU flash kernel (AVX-512, ~120-200 GFLOP/s here)
// and the parts merged by their log-sum-exp in Python. Here one pass per (kv head, 16 query rows) keeps a single
// running softmax over every key, and the tiles' bfloat16 dot products (TDPBF16PS, 16 x 16 x 32 each) do both
// products, computed transposed so that every float32 vector holds one key's (or one head dim's) value for the 16
// rows and the softmax needs no horizontal reductions:
//
//   S^T = K Q^T   keys straight from the pool as A tiles (16 keys x 32 dims), Q^T packed once per item as B tiles
//   softmax       max / rescale / sum elementwise over the 16 rows, exp by a polynomial, P^T rounded to bfloat16
//                 and interleaved by key pairs into a B tile
//   O^T += V^T P^T  values packed once per call, transposed, as A tiles (16 dims x 32 keys); for head sizes up to
//                 64, O^T stays in tiles for the whole pass, and the running maximum the probabilities are taken
//                 against moves only when a row's grows by more than kSlack, so the tiles are stored, rescaled and
//                 reloaded only then (most blocks need no round trip between the tiles and the vector registers)
//
// Query rows are (token, query head of the kv head) pairs, so the query heads sharing a kv head (GQA) read its keys
// once. Items are independent and run in parallel; each writes its rows' outputs in place.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PREFIXSERVE_AMX 1
#endif

namespace {

#ifdef PREFIXSERVE_AMX

constexpr int64_t kRows = 16;      // query rows per item (a tile's rows)
constexpr int64_t kKeys = 64;      // keys per block: four 16-key score tiles, two 32-key P tiles
constexpr float kNoScore = -1.0e30f;  // finite "minus infinity" (-ffast-math)
constexpr float kSlack = 8.0f;        // how far a row's maximum may grow before O^T kept in tiles is rescaled

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); once per process
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// 2^t for 16 finite floats: 2^n * 2^f with n = round(t), |f| <= 1/2, 2^f by its Taylor series to degree 4 (relative
// error < 5e-5, against the 2^-9 of the bfloat16 rounding P gets next); very negative t (a masked score) gives exactly 0
inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.00961812910762847716f);  // ln(2)^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041086648215800f));  // ln(2)^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226506959100712f));   // ln(2)^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147180559945309f));   // ln(2)
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr float kLog2E = 1.44269504088896341f;

inline uint16_t to_bf16(float value) {  // round to nearest even (values here are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The 16 x 16 matrix of 32-bit words in ``r`` transposed in place: 32-bit, then 64-bit interleaves within each
// 128-bit lane, then a 4 x 4 transpose of the lanes.
inline void transpose_words(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);  // per lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1]
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], lane l: rows g .. g + 3 of column c + 4 l
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Values of one kv head, transposed into A tiles of O^T = V^T P^T: per block of kKeys keys, per 16 head dims, per 32
// keys, a 16 x 32 tile whose row d holds dim d of those 32 keys. Keys past ``length`` are zeros. Each tile is two
// keys' dims interleaved into 32-bit words (key pair p, dim d), then those 16 x 16 words transposed.
void pack_values(const uint16_t* v, const int64_t* slots, int64_t length, int64_t slot_stride, int64_t head_dim,
                 int64_t blocks, uint16_t* packed) {
  static const uint16_t zeros[128] = {};  // a missing key: head_dim <= 128
  const int64_t slices = head_dim / 16, halves = kKeys / 32;
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const uint16_t* keys[32];
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t h = 0; h < halves; ++h) {
      for (int64_t t = 0; t < 32; ++t) {
        const int64_t key = b * kKeys + h * 32 + t;
        keys[t] = key < length ? v + slots[key] * slot_stride : zeros;
      }
      for (int64_t s = 0; s < slices; ++s) {
        __m512i words[16];
        for (int p = 0; p < 16; ++p) {
          const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys[2 * p] + s * 16));
          const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys[2 * p + 1] + s * 16));
          words[p] = _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
        }
        transpose_words(words);
        uint16_t* tile = packed + ((b * slices + s) * halves + h) * 512;
        for (int d = 0; d < 16; ++d) _mm512_storeu_si512(tile + d * 32, words[d]);
      }
    }
}

// S^T of 16 keys (rows ``key_stride`` elements apart, loaded as A tiles into tile 4) against the Q^T tiles 0 ..
// SLICES - 1, accumulated in tile TILE and stored as 16 keys x 16 rows of float32 at ``scores``. A macro: GCC's tile
// intrinsics paste the tile number into the instruction, so it must be a literal, not a template parameter.
#define PREFIXSERVE_SCORE_KEYS(TILE, SLICES, keys, key_stride, scores) \
  do {                                                                 \
    _tile_zero(TILE);                                                  \
    _tile_loadd(4, (keys), (key_stride) * 2);                          \
    _tile_dpbf16ps(TILE, 4, 0);                                        \
    if constexpr ((SLICES) > 1) {                                      \
      _tile_loadd(4, (keys) + 32, (key_stride) * 2);                   \
      _tile_dpbf16ps(TILE, 4, 1);                                      \
    }                                                                  \
    if constexpr ((SLICES) > 2) {                                      \
      _tile_loadd(4, (keys) + 64, (key_stride) * 2);                   \
      _tile_dpbf16ps(TILE, 4, 2);                                      \
      _tile_loadd(4, (keys) + 96, (key_stride) * 2);                   \
      _tile_dpbf16ps(TILE, 4, 3);                                      \
    }                                                                  \
    _tile_stored(TILE, (scores), 64);                                  \
  } while (0)

// O^T kept in tiles (head dims up to 64): its 16-dim columns in tiles 2, 3 (and 6, 7 for 64 dims), applied as
// OP(tile, buffer + column * 256) with ``result`` [dim][row] as the buffer. Inside run_rows only (kDim, result).
#define PREFIXSERVE_TILE_ZERO(TILE, buffer, stride) _tile_zero(TILE)
#define PREFIXSERVE_TILE_STORE(TILE, buffer, stride) _tile_stored(TILE, buffer, stride)
#define PREFIXSERVE_TILE_LOAD(TILE, buffer, stride) _tile_loadd(TILE, buffer, stride)
#define PREFIXSERVE_OUT_TILES(OP)            \
  do {                                       \
    OP(2, result, 64);                       \
    OP(3, result + 256, 64);                 \
    if constexpr (kDim == 64) {              \
      OP(6, result + 512, 64);               \
      OP(7, result + 768, 64);               \
    }                                        \
  } while (0)

struct Chunk {
  const uint16_t* query;   // [tokens, heads, dim]
  uint16_t* out;           // [tokens, heads, dim]
  int64_t num_heads, group, num_rows;  // rows = tokens x group
  const uint16_t* const* block_keys;   // per block: its first key of this call's kv head 0 (pool or gathered copy)
  int64_t key_stride;                  // elements between consecutive keys (a pool slot's, in both)
  int64_t length, context_len, blocks; // keys in all; keys before the chunk's own tokens
  float scale;
};

// One item: up to 16 query rows of one kv head against all the keys they see.
template <int kDim>
void run_rows(const Chunk& c, int64_t kv_head, int64_t first_row, const uint16_t* values) {
  constexpr int kSlices = kDim / 32;   // Q^T tiles (32 dims each)
  constexpr int kColumns = kDim / 16;  // O^T tiles (16 dims each)
  constexpr bool kResident = kDim <= 64;  // O^T fits the tiles the scores leave free
  const int64_t num_rows = std::min(kRows, c.num_rows - first_row);
  auto row_offset = [&](int64_t n) {  // element offset of row first_row + n in query / out
    const int64_t row = first_row + n;
    return ((row / c.group) * c.num_heads + kv_head * c.group + row % c.group) * kDim;
  };
  alignas(64) uint32_t q_tiles[kSlices * 256];  // [slice][dim pair][row]
  for (int64_t n = 0; n < 16; ++n) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(c.query + row_offset(std::min(n, num_rows - 1)));
    for (int s = 0; s < kSlices; ++s)
      for (int64_t p = 0; p < 16; ++p) q_tiles[s * 256 + p * 16 + n] = n < num_rows ? words[s * 16 + p] : 0u;
  }
  _tile_loadd(0, q_tiles, 64);  // tile numbers are immediates: one line per Q^T tile
  if constexpr (kSlices > 1) _tile_loadd(1, q_tiles + 256, 64);
  if constexpr (kSlices > 2) {
    _tile_loadd(2, q_tiles + 512, 64);
    _tile_loadd(3, q_tiles + 768, 64);
  }
  // a row sees the context and its own tokens up to itself: keys [0, context_len + token]; blocks past the item's
  // last token are skipped, blocks reaching past its first token are masked per row
  const int64_t first_visible = c.context_len + first_row / c.group;
  const int64_t last_visible = c.context_len + (first_row + num_rows - 1) / c.group;
  const int64_t blocks = std::min(c.blocks, last_visible / kKeys + 1);
  alignas(64) int32_t row_limits[16];
  for (int64_t n = 0; n < 16; ++n)
    row_limits[n] = static_cast<int32_t>(c.context_len + (first_row + std::min(n, num_rows - 1)) / c.group);
  const __m512i limits = _mm512_load_si512(row_limits);

  alignas(64) float scores[kKeys * 16];        // S^T: [key][row]
  alignas(64) uint16_t probs[kKeys * 16];      // P^T as B tiles of 32 keys: [key pair][row][2]
  alignas(64) float part[16 * 16];             // O^T of one block for 16 dims: [dim][row]
  alignas(64) float result[kDim * 16];         // O^T: [dim][row]
  __m512 acc[kResident ? 1 : kDim];            // O^T when it is not kept in tiles: [dim] -> 16 rows
  if constexpr (kResident) {
    PREFIXSERVE_OUT_TILES(PREFIXSERVE_TILE_ZERO);
  } else {
    for (int d = 0; d < kDim; ++d) acc[d] = _mm512_setzero_ps();
  }
  __m512 top = _mm512_set1_ps(kNoScore), total = _mm512_setzero_ps();
  const __m512 vscale = _mm512_set1_ps(c.scale), vscale2 = _mm512_set1_ps(c.scale * kLog2E), none = _mm512_set1_ps(kNoScore), slack = _mm512_set1_ps(kSlack);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t valid = std::min(kKeys, c.length - b * kKeys);
    const uint16_t* block_keys = c.block_keys[b] + kv_head * kDim;
    // S^T for 16 keys at a time: in tiles 5 and 6 by turns, or in tile 5 alone when tiles 6 and 7 hold O^T
    for (int64_t quarter = 0; quarter < kKeys / 16; quarter += 2) {
      PREFIXSERVE_SCORE_KEYS(5, kSlices, block_keys + quarter * 16 * c.key_stride, c.key_stride,
                             scores + quarter * 256);
      if constexpr (kDim == 64) {
        PREFIXSERVE_SCORE_KEYS(5, kSlices, block_keys + (quarter + 1) * 16 * c.key_stride, c.key_stride,
                               scores + (quarter + 1) * 256);
      } else {
        PREFIXSERVE_SCORE_KEYS(6, kSlices, block_keys + (quarter + 1) * 16 * c.key_stride, c.key_stride,
                               scores + (quarter + 1) * 256);
      }
    }
    // running softmax, elementwise over the 16 rows (scale > 0: the raw maximum scales to the scaled one)
    __m512 raw_top = none;
    if (b * kKeys + valid - 1 > first_visible) {  // some row does not see some key of this block
      for (int64_t t = 0; t < valid; ++t) {
        const __mmask16 sees = _mm512_cmp_epi32_mask(limits, _mm512_set1_epi32(static_cast<int32_t>(b * kKeys + t)),
                                                     _MM_CMPINT_GE);
        const __m512 masked = _mm512_mask_blend_ps(sees, none, _mm512_load_ps(scores + t * 16));
        _mm512_store_ps(scores + t * 16, masked);
        raw_top = _mm512_max_ps(raw_top, masked);
      }
    } else {
      for (int64_t t = 0; t < valid; ++t) raw_top = _mm512_max_ps(raw_top, _mm512_load_ps(scores + t * 16));
    }
    const __m512 block_top = _mm512_mul_ps(raw_top, vscale);
    // O^T in tiles: the maximum the probabilities are taken against moves only when a row's grows by more than
    // kSlack (so they stay <= e^kSlack), and only then are the tiles stored, rescaled and loaded back. Row 0 of
    // every item sees key 0, so the first block sets every row's maximum.
    __m512 rescale = _mm512_set1_ps(1.0f);
    if (!kResident || _mm512_cmp_ps_mask(block_top, _mm512_add_ps(top, slack), _CMP_GT_OQ)) {
      const __m512 new_top = _mm512_max_ps(top, block_top);
      rescale = exp2_16(_mm512_mul_ps(_mm512_sub_ps(top, new_top), _mm512_set1_ps(kLog2E)));
      top = new_top;
      if constexpr (kResident) {
        if (b > 0) {
          PREFIXSERVE_OUT_TILES(PREFIXSERVE_TILE_STORE);
          for (int d = 0; d < kDim; ++d)
            _mm512_store_ps(result + d * 16, _mm512_mul_ps(_mm512_load_ps(result + d * 16), rescale));
          PREFIXSERVE_OUT_TILES(PREFIXSERVE_TILE_LOAD);
        }
      }
    }
    const __m512 top2 = _mm512_mul_ps(top, _mm512_set1_ps(kLog2E));  // exp(s scale - top) = 2^(s scale2 - top2)
    __m512 block_total = _mm512_setzero_ps();
    for (int64_t t = 0; t < kKeys; t += 2) {
      const __m512 p0 = t < valid ? exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores + t * 16), vscale2, top2))
                                  : _mm512_setzero_ps();
      const __m512 p1 = t + 1 < valid ? exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores + (t + 1) * 16), vscale2, top2))
                                      : _mm512_setzero_ps();
      block_total = _mm512_add_ps(block_total, _mm512_add_ps(p0, p1));
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));  // [p0 rows..., p1 rows...]
      _mm512_store_si512(reinterpret_cast<__m512i*>(probs + t * 16), _mm512_permutexvar_epi16(pairs, both));
    }
    // the sum is of the float32 probabilities while the values are weighted by their bfloat16 roundings: each
    // rounding is off by at most 2^-9 relative, independently, which stays within the bfloat16 output's own rounding
    total = _mm512_fmadd_ps(total, rescale, block_total);
    const uint16_t* block_values = values + b * kColumns * 2 * 512;
    if constexpr (kResident) {  // O^T += V^T P^T, 32 keys at a time, straight into the output tiles
      for (int half = 0; half < 2; ++half) {
        _tile_loadd(5, probs + half * 512, 64);
        _tile_loadd(4, block_values + half * 512, 64);
        _tile_dpbf16ps(2, 4, 5);
        if constexpr (kDim == 64) {
          _tile_loadd(4, block_values + (2 + half) * 512, 64);
          _tile_dpbf16ps(3, 4, 5);
          _tile_loadd(4, block_values + (4 + half) * 512, 64);
          _tile_dpbf16ps(6, 4, 5);
          _tile_loadd(4, block_values + (6 + half) * 512, 64);
          _tile_dpbf16ps(7, 4, 5);
        } else {
          _tile_loadd(4, block_values + (2 + half) * 512, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
    } else {
      _tile_loadd(5, probs, 64);
      _tile_loadd(6, probs + 512, 64);
      for (int col = 0; col < kColumns; ++col) {
        _tile_zero(7);
        _tile_loadd(4, block_values + (col * 2) * 512, 64);
        _tile_dpbf16ps(7, 4, 5);
        _tile_loadd(4, block_values + (col * 2 + 1) * 512, 64);
        _tile_dpbf16ps(7, 4, 6);
        _tile_stored(7, part, 64);
        for (int d = 0; d < 16; ++d)
          acc[col * 16 + d] = _mm512_fmadd_ps(acc[col * 16 + d], rescale, _mm512_load_ps(part + d * 16));
      }
    }
  }
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
  if constexpr (kResident) {
    PREFIXSERVE_OUT_TILES(PREFIXSERVE_TILE_STORE);
    for (int d = 0; d < kDim; ++d)
      _mm512_store_ps(result + d * 16, _mm512_mul_ps(_mm512_load_ps(result + d * 16), inverse));
  } else {
    for (int d = 0; d < kDim; ++d) _mm512_store_ps(result + d * 16, _mm512_mul_ps(acc[d], inverse));
  }
  for (int64_t n = 0; n < num_rows; ++n) {
    uint16_t* out = c.out + row_offset(n);
    for (int d = 0; d < kDim; ++d) out[d] = to_bf16(result[d * 16 + n]);
  }
}

#endif  // PREFIXSERVE_AMX

bool has_amx() {
#ifdef PREFIXSERVE_AMX
  return request_amx();
#else
  return false;
#endif
}

// query / out [tokens, heads, dim] bfloat16, contiguous; k_cache / v_cache [slots, kv_heads, dim] bfloat16,
// contiguous (a layer's pool); runs [R, 2] int64: (first slot, length) of the context's runs in order, the chunk's own
// tokens being the last ``tokens`` keys. dim in {32, 64, 128}.
void prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& runs, double scale, at::Tensor& out) {
  TORCH_CHECK(has_amx(), "prefill_attention: this build or CPU has no AMX tiles");
#ifdef PREFIXSERVE_AMX
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && out.sizes() == query.sizes() &&
                  v_cache.sizes() == k_cache.sizes(), "prefill_attention: bad shapes");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &k_cache, &v_cache, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous(), "prefill_attention: contiguous bfloat16 only");
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_slots = k_cache.size(0), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && num_heads % num_kv_heads == 0, "prefill_attention: head mismatch");
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128, "prefill_attention: head size 32, 64 or 128 only");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 2 && runs.is_contiguous(),
              "prefill_attention: runs must be [R, 2] int64");
  const int64_t* run = runs.data_ptr<int64_t>();
  std::vector<int64_t> slots;
  for (int64_t r = 0; r < runs.size(0); ++r) {  // bounds: a bad plan must not read outside the pool
    TORCH_CHECK(run[2 * r] >= 0 && run[2 * r + 1] >= 0 && run[2 * r + 1] <= num_slots - run[2 * r],
                "prefill_attention: run outside the pool");
    for (int64_t i = 0; i < run[2 * r + 1]; ++i) slots.push_back(run[2 * r] + i);
  }
  const int64_t length = static_cast<int64_t>(slots.size());
  TORCH_CHECK(tokens > 0 && length >= tokens, "prefill_attention: the runs must end with the chunk's own tokens");
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t blocks = (length + kKeys - 1) / kKeys;
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  // keys: a block whose 64 keys are consecutive slots is read in place; any other (a run ends inside it, or it is the
  // last, partial block) is copied into a zero-padded block first, so no tile load reads outside the keys
  std::vector<const uint16_t*> block_keys(blocks);
  std::vector<int64_t> copied;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kKeys, n = std::min(kKeys, length - first);
    bool consecutive = n == kKeys;
    for (int64_t t = 1; consecutive && t < n; ++t) consecutive = slots[first + t] == slots[first] + t;
    if (consecutive) block_keys[b] = k + slots[first] * slot_stride;
    else copied.push_back(b);
  }
  std::vector<uint16_t> gathered(copied.size() * kKeys * slot_stride, 0);
  for (size_t i = 0; i < copied.size(); ++i) {
    const int64_t first = copied[i] * kKeys, n = std::min(kKeys, length - first);
    uint16_t* dst = gathered.data() + i * kKeys * slot_stride;
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(dst + t * slot_stride, k + slots[first + t] * slot_stride, slot_stride * 2);
    block_keys[copied[i]] = dst;
  }
  const int64_t value_elements = blocks * kKeys * head_dim;  // per kv head
  std::vector<uint16_t> packed_values(num_kv_heads * value_elements);
  at::parallel_for(0, num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      pack_values(v + h * head_dim, slots.data(), length, slot_stride, head_dim, blocks,
                  packed_values.data() + h * value_elements);
  });
  const int64_t group = num_heads / num_kv_heads;
  const Chunk chunk{reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), num_heads, group, tokens * group,
                    block_keys.data(), slot_stride, length, length - tokens, blocks, static_cast<float>(scale)};
  const int64_t row_blocks = (chunk.num_rows + kRows - 1) / kRows;
  at::parallel_for(0, num_kv_heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_blocks, first = (item % row_blocks) * kRows;
      const uint16_t* hv = packed_values.data() + h * value_elements;
      switch (head_dim) {
        case 32: run_rows<32>(chunk, h, first, hv); break;
        case 64: run_rows<64>(chunk, h, first, hv); break;
        default: run_rows<128>(chunk, h, first, hv); break;
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) {
  m.def("has_amx() -> bool", &has_amx);
  m.def("prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor runs, float scale, Tensor(a!) out) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
