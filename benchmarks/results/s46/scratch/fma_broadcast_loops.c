// Probe (session 46): float32 FMA loops shaped as the prefill kernel's scores (a key value broadcast per FMA against 16 rows),
// with 8 chains and with 2 row vectors per broadcast. gcc -O2 -march=native fma_broadcast_loops.c -o /tmp/f && /tmp/f
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
float keys[64*128] __attribute__((aligned(64)));
float q[64*16] __attribute__((aligned(64)));
int main(){
  for(int i=0;i<64*128;i++) keys[i]=1e-6f*i; for(int i=0;i<64*16;i++) q[i]=1e-6f;
  __m512 acc[16]; long N=2000000; double t, dt; float s;
  // 8 keys x 1 row vector: per d, 1 q load + 8 broadcasts (the kernel's scores<8>)
  for(int i=0;i<16;i++) acc[i]=_mm512_setzero_ps();
  t=now();
  for(long n=0;n<N;n++){
    const float* k = keys + (n & 7) * 8;
    for(int d=0; d<64; d++){ __m512 qv=_mm512_load_ps(q+d*16);
      #pragma GCC unroll 8
      for(int i=0;i<8;i++) acc[i]=_mm512_fmadd_ps(_mm512_set1_ps(k[i*128+d]),qv,acc[i]); }
  }
  dt=now()-t; s=0; for(int i=0;i<16;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("8 keys x 16 rows (bcast per FMA): %.1f GFLOP/s (%g)\n", N*64*8*32.0/dt/1e9, s);
  // 4 keys x 2 row vectors: per d, 2 q loads + 4 broadcasts, 8 FMAs
  for(int i=0;i<16;i++) acc[i]=_mm512_setzero_ps();
  t=now();
  for(long n=0;n<N;n++){
    const float* k = keys + (n & 7) * 8;
    for(int d=0; d<64; d++){ __m512 q0=_mm512_load_ps(q+d*16), q1=_mm512_load_ps(q+((d+1)&63)*16);
      #pragma GCC unroll 4
      for(int i=0;i<4;i++){ __m512 b=_mm512_set1_ps(k[i*128+d]); acc[2*i]=_mm512_fmadd_ps(b,q0,acc[2*i]); acc[2*i+1]=_mm512_fmadd_ps(b,q1,acc[2*i+1]);} }
  }
  dt=now()-t; s=0; for(int i=0;i<16;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("4 keys x 32 rows (bcast per 2 FMA): %.1f GFLOP/s (%g)\n", N*64*8*32.0/dt/1e9, s);
  // 6 keys x 2 row vectors: 12 FMAs per 2 q + 6 broadcasts
  for(int i=0;i<16;i++) acc[i]=_mm512_setzero_ps();
  t=now();
  for(long n=0;n<N;n++){
    const float* k = keys + (n & 7) * 8;
    for(int d=0; d<64; d++){ __m512 q0=_mm512_load_ps(q+d*16), q1=_mm512_load_ps(q+((d+1)&63)*16);
      #pragma GCC unroll 6
      for(int i=0;i<6;i++){ __m512 b=_mm512_set1_ps(k[i*128+d]); acc[2*i]=_mm512_fmadd_ps(b,q0,acc[2*i]); acc[2*i+1]=_mm512_fmadd_ps(b,q1,acc[2*i+1]);} }
  }
  dt=now()-t; s=0; for(int i=0;i<16;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("6 keys x 32 rows (bcast per 2 FMA): %.1f GFLOP/s (%g)\n", N*64*12*32.0/dt/1e9, s);
}
