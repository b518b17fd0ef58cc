/* A hand-written small-row fp32 GEMM for AVX2 + FMA (a candidate of issue 11, measured by
 * benchmarks/bench_small_gemm.py; not used by lookahead): out[M, N] = x[M, K] · Wᵀ with W packed as
 * [N/16][K][16]. Each block of 16 outputs keeps up to 6 rows × 2 vectors of accumulators in registers, streams
 * its 16 weight columns once per 6 rows and broadcasts x; OpenMP splits the blocks over the threads. */
#include <immintrin.h>
#include <omp.h>
#define SPEC(R) static void block##R(const float* x,int M0,int K,int ldx,const float* wb,float* out,int ldo,int n0){ \
    __m256 a0[R],a1[R]; for(int m=0;m<R;m++){a0[m]=_mm256_setzero_ps();a1[m]=_mm256_setzero_ps();} \
    for(int k=0;k<K;k++){ __m256 w0=_mm256_loadu_ps(wb+k*16), w1=_mm256_loadu_ps(wb+k*16+8); \
      _Pragma("GCC unroll 8") for(int m=0;m<R;m++){ __m256 xv=_mm256_broadcast_ss(x+(M0+m)*ldx+k); a0[m]=_mm256_fmadd_ps(xv,w0,a0[m]); a1[m]=_mm256_fmadd_ps(xv,w1,a1[m]);} } \
    for(int m=0;m<R;m++){_mm256_storeu_ps(out+(M0+m)*ldo+n0,a0[m]);_mm256_storeu_ps(out+(M0+m)*ldo+n0+8,a1[m]);} }
SPEC(1) SPEC(2) SPEC(3) SPEC(4) SPEC(5) SPEC(6)
typedef void (*bf)(const float*,int,int,int,const float*,float*,int,int);
static bf B[7]={0,block1,block2,block3,block4,block5,block6};
void mm(const float* x, int M, int K, const float* wp, int N, float* out){
    int nb=N/16;
    #pragma omp parallel for schedule(static)
    for(int b=0;b<nb;b++){
        const float* wb=wp+(long)b*K*16;
        for(int m0=0;m0<M;m0+=6){int r=M-m0<6?M-m0:6; B[r](x,m0,K,K,wb,out,N,b*16);}
    }
}
