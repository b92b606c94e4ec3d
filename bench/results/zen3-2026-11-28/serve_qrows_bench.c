#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include "cpu/gemm_int8_internal.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int64_t shapes[][2]={{2304,768},{768,768},{3072,768},{768,3072},{50257,768}};
  int64_t L=12; /* layers: separate weights so the model does not sit in cache */
  for(int s=0;s<5;s++){int64_t N=shapes[s][0],K=shapes[s][1]; int64_t nl=s==4?1:L;
   int8_t*w=malloc(nl*N*K),*xq=malloc(32*K); float*ws=malloc(N*4),*sx=malloc(32*4),*y=malloc(32*N*4);
   for(int64_t i=0;i<nl*N*K;i++)w[i]=(int8_t)(rand()%255-127);
   for(int64_t i=0;i<32*K;i++)xq[i]=(int8_t)(rand()%255-127);
   for(int64_t i=0;i<N;i++)ws[i]=1e-3f; for(int i=0;i<32;i++)sx[i]=1e-2f;
   printf("N=%5lld K=%4lld x%2lld:",(long long)N,(long long)K,(long long)nl);
   int Ms[]={1,16}; double t1=0;
   for(int mi=0;mi<2;mi++){int64_t M=Ms[mi]; double best=1e9;
    for(int r=0;r<3;r++){double t0=now(); for(int l=0;l<nl;l++){anneal_qrows_s8_args q={.M=M,.N=N,.K=K,.xq=xq,.sx=sx,.w=w+l*N*K,.wscale=ws,.bias=NULL,.y=y}; anneal_qrows_s8_avx2(&q,0,N);} double t=now()-t0; if(t<best)best=t;}
    if(mi==0)t1=best; printf("  M=%2lld %.2f ms (%.1f GMAC/s)",(long long)M,best*1e3,M*N*K*nl/best/1e9);
    if(mi==1)printf("  ratio %.2f",best/t1);}
   printf("\n"); free(w);}
}
