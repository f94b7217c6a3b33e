#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512 acc[12]; for(int i=0;i<12;i++) acc[i]=_mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi16(0x3f80), b=(__m512bh)_mm512_set1_epi16(0x3f80);
  long N=200000000/12;
  double t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) acc[i]=_mm512_dpbf16_ps(acc[i],a,b);
  }
  double dt=now()-t; float s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("dpbf16: %.1f GFLOP/s (%g)\n", N*12.0*64/dt/1e9, s);
  __m512 x=_mm512_set1_ps(1.0001f), y=_mm512_set1_ps(0.9999f);
  for(int i=0;i<12;i++) acc[i]=_mm512_setzero_ps();
  t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) acc[i]=_mm512_fmadd_ps(x,y,acc[i]);
  }
  dt=now()-t; s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("fma512: %.1f GFLOP/s (%g)\n", N*12.0*32/dt/1e9, s);
}
