/* fp32 linear layers on the CPU over packed weights: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * The weight is packed once, at load, as blocks of 16 output rows: wp[N/16][K][16] holds
 * w[16b + i][k] at [b][k][i] (the last block zero-padded). A tile multiplies two blocks (32
 * outputs) by up to 6 input rows: per k it loads two 16-wide weight vectors, broadcasts each
 * row's x[k], and accumulates 32 x 6 products in registers; no horizontal sums, one sequential
 * pass over the weight whatever M is.
 *
 * Why: decoding and verifying drafts multiply a few rows by large weights. With the usual
 * [N, K] layout, torch's BLAS reaches ~11 GB/s on such shapes here, and a row-blocked kernel
 * costs 1.6-2x more for 2-4 rows than for one; packed, 1-8 rows cost about what one row costs
 * (the weight is read once), so verifying 4 drafted tokens costs about a 1-token step. For
 * prefill-sized M the same tiles run near the machine's peak (~220 GFLOP/s on the 2-core EPYC
 * against ~160 for torch). Each output is summed over k in order, the same way whatever M and
 * the tile are: a row's result does not depend on the rest of the batch.
 *
 * GCC vector extensions: AVX-512 where -march=native has it, two AVX2 halves otherwise.
 */
#include <stddef.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }

static inline void store_block(v16 acc, const float* bias, float* y, int n0, int N) {
    float lanes[16];
    memcpy(lanes, &acc, sizeof lanes);
    int n = N - n0 < 16 ? N - n0 : 16;
    for (int i = 0; i < n; i++) y[n0 + i] = lanes[i] + (bias ? bias[n0 + i] : 0.f);
}

/* The tiles also read int8 weights with one fp32 scale per output row: w[n][k] ~ scale[n] * q[n][k],
 * packed the same way (qp[N/16][K][16]). Each 16-wide int8 vector is widened to fp32 in
 * registers; the row's scale multiplies the finished sum. A quarter of the fp32 weight's bytes
 * to read: for a draft model made of the target's quantized weights (spec/draft_model.py). */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
static inline v16 ldq(const signed char* p) {  /* 16 int8 -> 16 fp32 (GCC scalarizes __builtin_convertvector here) */
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    v16 v; memcpy(&v, halves, sizeof v); return v;
#else
    v16 v; for (int i = 0; i < 16; i++) v[i] = (float)p[i]; return v;
#endif
}
static inline v16 unscaled(v16 acc, const float* scale, int n0) { (void)scale; (void)n0; return acc; }
static inline v16 scaled(v16 acc, const float* scale, int n0) { return acc * ld(scale + n0); }

/* NAME##MC: MC input rows x (up to) two blocks, weights of type WT read by LOAD, sums finished by FINISH */
#define DEFINE_TILE(NAME, MC, WT, LOAD, FINISH)                                                   \
static void NAME##MC(const float* x, int K, const WT* wp, const float* scale, const float* bias, \
                     float* y, int N, int nb0, int two) {                                         \
    v16 acc0[MC], acc1[MC];                                                                       \
    for (int c = 0; c < MC; c++) { acc0[c] = (v16){0}; acc1[c] = (v16){0}; }                      \
    const WT* w0 = wp + (size_t)nb0 * K * 16;                                                     \
    const WT* w1 = w0 + (size_t)K * 16;                                                           \
    if (two) {                                                                                    \
        for (int k = 0; k < K; k++) {                                                             \
            v16 a = LOAD(w0 + (size_t)k * 16), b = LOAD(w1 + (size_t)k * 16);                     \
            for (int c = 0; c < MC; c++) {                                                        \
                float s = x[(size_t)c * K + k];                                                   \
                acc0[c] += a * s;                                                                 \
                acc1[c] += b * s;                                                                 \
            }                                                                                     \
        }                                                                                         \
    } else {                                                                                      \
        for (int k = 0; k < K; k++) {                                                             \
            v16 a = LOAD(w0 + (size_t)k * 16);                                                    \
            for (int c = 0; c < MC; c++) acc0[c] += a * x[(size_t)c * K + k];                     \
        }                                                                                         \
    }                                                                                             \
    for (int c = 0; c < MC; c++) {                                                                \
        store_block(FINISH(acc0[c], scale, nb0 * 16), bias, y + (size_t)c * N, nb0 * 16, N);      \
        if (two) store_block(FINISH(acc1[c], scale, nb0 * 16 + 16), bias, y + (size_t)c * N, nb0 * 16 + 16, N); \
    }                                                                                             \
}
#define DEFINE_TILES(NAME, WT, LOAD, FINISH)                                                      \
    DEFINE_TILE(NAME, 1, WT, LOAD, FINISH) DEFINE_TILE(NAME, 2, WT, LOAD, FINISH)                 \
    DEFINE_TILE(NAME, 3, WT, LOAD, FINISH) DEFINE_TILE(NAME, 4, WT, LOAD, FINISH)                 \
    DEFINE_TILE(NAME, 5, WT, LOAD, FINISH) DEFINE_TILE(NAME, 6, WT, LOAD, FINISH)                 \
    static void (*const NAME##s[7])(const float*, int, const WT*, const float*, const float*, float*, int, int, int) = \
        {0, NAME##1, NAME##2, NAME##3, NAME##4, NAME##5, NAME##6};
DEFINE_TILES(tile, float, ld, unscaled)
DEFINE_TILES(tileq, signed char, ldq, scaled)

/* each thread owns whole pairs of blocks: their 2 x 16 x K weights stay in its cache while every
   input row passes over them */
#define RUN_TILES(TILES, WP, SCALE)                                                               \
    int nblocks = (N + 15) / 16, npairs = (nblocks + 1) / 2;                                      \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
    for (int p = 0; p < npairs; p++) {                                                            \
        int nb0 = 2 * p, two = nblocks - nb0 >= 2;                                                \
        for (int m0 = 0; m0 < M; m0 += 6) {                                                       \
            int mc = M - m0 < 6 ? M - m0 : 6;                                                     \
            TILES[mc](x + (size_t)m0 * K, K, WP, SCALE, bias, y + (size_t)m0 * N, N, nb0, two);   \
        }                                                                                         \
    }

void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y,
                       int M, int N, int K, int threads) {
    RUN_TILES(tiles, wp, (const float*)0)
}

/* scale has ceil(N/16)*16 entries (zero-padded like the blocks) */
void packed_linear_i8(const float* x, const signed char* qp, const float* scale, const float* bias, float* y,
                      int M, int N, int K, int threads) {
    RUN_TILES(tileqs, qp, scale)
}
