#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include "cpu/gemm_int8_internal.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* One GPT-2 124M decode step's int8 products (12 layers of qkv 2304x768, o 768x768, fc 3072x768,
 * proj 768x3072, and the 50257x768 head), one thread: M = 1 and 16 rows with the sign-trick
 * kernel (before), and 16 rows with the int16 kernel where K <= 1024 (after), interleaved. */
int main(void){
  int64_t shapes[][2]={{2304,768},{768,768},{3072,768},{768,3072},{50257,768}};
  int8_t*w[5]; int8_t*xq=malloc(16*3072); int16_t*x16=malloc(16*3072*2); float*ws=malloc(50257*4),*sx=malloc(64),*y=malloc(16*50257*4);
  for(int s=0;s<5;s++){int64_t n=(s==4?1:12)*shapes[s][0]*shapes[s][1]; w[s]=malloc(n); for(int64_t i=0;i<n;i++)w[s][i]=(int8_t)(rand()%256-128);}
  for(int i=0;i<16*3072;i++){xq[i]=(int8_t)(rand()%255-127);x16[i]=xq[i];} for(int i=0;i<50257;i++)ws[i]=1e-3f; for(int i=0;i<16;i++)sx[i]=1e-2f;
  double best[3]={1e9,1e9,1e9};
  for(int round=0;round<6;round++) for(int v=0;v<3;v++){ double t0=now();
    for(int s=0;s<5;s++){int64_t N=shapes[s][0],K=shapes[s][1],nl=s==4?1:12;
      for(int l=0;l<nl;l++){anneal_qrows_s8_args q={.M=v==0?1:16,.N=N,.K=K,.xq=xq,.sx=sx,.w=w[s]+l*N*K,.wscale=ws,.y=y};
        if(v==2&&K<=1024) anneal_qrows_s8_wide_avx2(&q,x16,0,N); else anneal_qrows_s8_avx2(&q,0,N);}}
    double t=now()-t0; if(t<best[v])best[v]=t;}
  printf("one step's int8 products, 1 thread: M=1 %.1f ms; M=16 before %.1f ms (%.2fx M=1 -> %.2fx throughput); M=16 after %.1f ms (%.2fx -> %.2fx)\n",
    best[0]*1e3,best[1]*1e3,best[1]/best[0],16*best[0]/best[1],best[2]*1e3,best[2]/best[0],16*best[0]/best[2]);
}
