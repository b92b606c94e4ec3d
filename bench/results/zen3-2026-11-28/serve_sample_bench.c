#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <time.h>
#include "anneal/model.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){ int V=50257; float*x=malloc(V*4); srand(1); for(int i=0;i<V;i++)x[i]=(float)(rand()/(double)RAND_MAX*8-4);
 anneal_sampler_config c={.temperature=1.0f,.top_k=0,.top_p=1.0f,.seed=7}; long sum=0;
 double t0=now(); for(int p=0;p<200;p++) sum+=anneal_sample_logits(x,V,&c,p); double t=now()-t0;
 printf("%.3f ms/row checksum %ld\n", t/200*1e3, sum);
 c.top_p=0.9f; t0=now(); for(int p=0;p<50;p++) sum+=anneal_sample_logits(x,V,&c,p); t=now()-t0; printf("top_p .9: %.3f ms/row checksum %ld\n", t/50*1e3, sum);}
