/* Skinny fp32 linear layers for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T + bias[N], M small.
 *
 * Decoding multiplies a few rows by large weight matrices: it is bound by reading the
 * weights once. The BLAS behind torch reaches ~11 GB/s on such shapes on our 2-core EPYC
 * machines; streaming each weight row once and reusing it for every input row reaches
 * close to the copy bandwidth. One row: a plain dot product per output (vectorized by the
 * compiler). Several rows: 4 weight rows x up to 4 input rows per block, 16-lane vectors.
 * Built at first use with -march=native (see __init__.py); large M goes to torch's GEMM.
 */
#include <stddef.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v16 v) { float s = 0.f; for (int i = 0; i < 16; i++) s += v[i]; return s; }

#define DEFINE_BLOCK(MC)                                                                          \
static void block##MC(const float* x, const float* w, const float* bias, float* y,               \
                      int m0, int n0, int ncount, int N, int K) {                                 \
    v16 acc[4][MC];                                                                               \
    for (int r = 0; r < 4; r++) for (int c = 0; c < MC; c++) acc[r][c] = (v16){0};                \
    const float* wr[4]; const float* xr[MC];                                                      \
    for (int r = 0; r < 4; r++) wr[r] = w + (size_t)(n0 + (r < ncount ? r : 0)) * K;              \
    for (int c = 0; c < MC; c++) xr[c] = x + (size_t)(m0 + c) * K;                                \
    int kv = K & ~15;                                                                             \
    for (int k = 0; k < kv; k += 16) {                                                            \
        v16 w0 = ld(wr[0] + k), w1 = ld(wr[1] + k), w2 = ld(wr[2] + k), w3 = ld(wr[3] + k);       \
        for (int c = 0; c < MC; c++) {                                                            \
            v16 xv = ld(xr[c] + k);                                                               \
            acc[0][c] += w0 * xv; acc[1][c] += w1 * xv; acc[2][c] += w2 * xv; acc[3][c] += w3 * xv; \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < ncount; r++)                                                              \
        for (int c = 0; c < MC; c++) {                                                            \
            float s = hsum(acc[r][c]);                                                            \
            for (int k = kv; k < K; k++) s += wr[r][k] * xr[c][k];                                \
            y[(size_t)(m0 + c) * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.f);                   \
        }                                                                                         \
}
DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)

static void gemv1(const float* restrict x, const float* restrict w, const float* restrict bias,
                  float* restrict y, int N, int K, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const float* wn = w + (size_t)n * K;
        float acc = 0.f;
        #pragma omp simd reduction(+:acc)
        for (int k = 0; k < K; k++) acc += wn[k] * x[k];
        y[n] = acc + (bias ? bias[n] : 0.f);
    }
}

void skinny_linear_f32(const float* x, const float* w, const float* bias, float* y,
                       int M, int N, int K, int threads) {
    if (M == 1) { gemv1(x, w, bias, y, N, K, threads); return; }
    int nblocks = (N + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nblocks; b++) {
        int n0 = b * 4, ncount = N - n0 < 4 ? N - n0 : 4;
        int m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) block4(x, w, bias, y, m0, n0, ncount, N, K);
        switch (M - m0) {
            case 3: block3(x, w, bias, y, m0, n0, ncount, N, K); break;
            case 2: block2(x, w, bias, y, m0, n0, ncount, N, K); break;
            case 1: block1(x, w, bias, y, m0, n0, ncount, N, K); break;
        }
    }
}
