// Probe (session 46): vdpbf16ps loops shaped as the bf16 prefill kernel's scores (a key pair broadcast per instruction against
// 16 rows), with 8, 12 and 16 accumulator chains. gcc -O2 -march=native dpbf16_broadcast_loops.c -o /tmp/d && /tmp/d
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
unsigned short keys[64*256] __attribute__((aligned(64)));
unsigned q[32*16] __attribute__((aligned(64)));
static inline __m512bh pair_of(const unsigned short* at){unsigned b; memcpy(&b,at,4); return (__m512bh)_mm512_set1_epi32((int)b);}
#define RUN(NK, LABEL) { __m512 acc[NK]; for(int i=0;i<NK;i++) acc[i]=_mm512_setzero_ps(); double t=now(); \
  for(long n=0;n<N;n++){ const unsigned short* k = keys + (n & 7) * 2; \
    for(int p=0;p<32;p++){ __m512bh qv=(__m512bh)_mm512_load_si512(q+p*16); \
      _Pragma("GCC unroll 16") for(int i=0;i<NK;i++) acc[i]=_mm512_dpbf16_ps(acc[i],qv,pair_of(k+i*256+2*p)); } } \
  double dt=now()-t; float s=0; for(int i=0;i<NK;i++) s+=_mm512_reduce_add_ps(acc[i]); \
  printf("%s: %.1f GFLOP/s (%g)\n", LABEL, N*32.0*NK*64/dt/1e9, s); }
int main(){ long N=2000000; for(int i=0;i<64*256;i++) keys[i]=0x3f80; for(int i=0;i<32*16;i++) q[i]=0x3f803f80;
  RUN(8, "8 keys x 16 rows"); RUN(12, "12 keys x 16 rows"); RUN(16, "16 keys x 16 rows"); return 0; }
