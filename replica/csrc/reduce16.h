// Sixteen 16-float vectors summed lane-wise into one: lane j of the result is the sum of all 16 lanes of the vector
// holding item j, in 4 rounds of shuffle + add (in place of a horizontal sum per item). The rounds leave the sums in
// the order kKeyOf: vector j must hold item kKeyOf[j] (the map is its own inverse). AVX-512 only; included by the
// decode attention kernel (16 keys' scores) and the small-row linear kernel (16 weight rows' outputs).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace prefixserve {

constexpr int kKeyOf[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline __m512 reduce16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // 128-bit quarters: each result holds two vectors' 8 partial sums
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // four vectors' 4 partial sums each
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within each quarter: eight vectors' 2 partial sums
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

}  // namespace prefixserve
#endif
