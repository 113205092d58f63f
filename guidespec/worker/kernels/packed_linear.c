/* fp32 linear layers on the CPU over packed weights: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * The weight is packed once, at load, as blocks of 16 output rows: wp[N/16][K][16] holds
 * w[16b + i][k] at [b][k][i] (the last block zero-padded). A tile multiplies two vectors of
 * outputs (2 x VW: two blocks with AVX-512, one block with AVX2) by up to 6 input rows: per k it
 * loads the two weight vectors, broadcasts each row's x[k], and accumulates 2 x 6 vectors of
 * products in registers (12 accumulators: AVX2's 16 registers hold them with the two weight
 * vectors and the broadcast); no horizontal sums, one sequential pass over the weight whatever
 * M is.
 *
 * Why: decoding and verifying drafts multiply a few rows by large weights. With the usual
 * [N, K] layout, torch's BLAS reaches ~11 GB/s on such shapes here, and a row-blocked kernel
 * costs 1.6-2x more for 2-4 rows than for one; packed, 1-8 rows cost about what one row costs
 * (the weight is read once), so verifying 4 drafted tokens costs about a 1-token step. For
 * prefill-sized M the same tiles run near the machine's peak. Each output is summed over k in
 * order, the same way whatever M, the tile and the vector width are: a row's result does not
 * depend on the rest of the batch.
 *
 * VW, the vector width, is the machine's own (vec.h).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "vec.h"

/* VW outputs from n0 (sum + bias), cut at N */
static inline void store_vec(vf acc, const float* bias, float* y, int n0, int N) {
    if (N - n0 >= VW) {  /* a whole vector: one store (a lane-by-lane one cost as much as the sums at K = 64) */
        st(y + n0, bias ? acc + ld(bias + n0) : acc);
        return;
    }
    float lanes[VW];
    memcpy(lanes, &acc, sizeof lanes);
    int n = N - n0 < VW ? N - n0 : VW;
    for (int i = 0; i < n; i++) y[n0 + i] = lanes[i] + (bias ? bias[n0 + i] : 0.f);
}

/* The tiles also read int8 weights with one fp32 scale per output row: w[n][k] ~ scale[n] * q[n][k],
 * packed the same way (qp[N/16][K][16]). Each int8 vector is widened to fp32 in registers; the
 * row's scale multiplies the finished sum. A quarter of the fp32 weight's bytes to read: for a
 * draft model made of the target's quantized weights (worker/drafting/draft_model.py). */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
static inline vf ldq(const signed char* p) {  /* VW int8 -> VW fp32 (GCC scalarizes __builtin_convertvector here) */
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
    vf v; for (int i = 0; i < VW; i++) v[i] = (float)p[i]; return v;
#endif
}
static inline vf unscaled(vf acc, const float* scale, int n0) { (void)scale; (void)n0; return acc; }
static inline vf scaled(vf acc, const float* scale, int n0) { return acc * ld(scale + n0); }

/* where output n's weight for k = 0 sits in the packed layout (n a multiple of VW) */
static inline size_t packed_at(int n, int K) { return (size_t)(n / 16) * K * 16 + n % 16; }

/* NAME##MC: MC input rows x the two output vectors from n0 (the second one only if `two`),
   weights of type WT read by LOAD, sums finished by FINISH */
#define DEFINE_TILE(NAME, MC, WT, LOAD, FINISH)                                                   \
static void NAME##MC(const float* x, int K, const WT* wp, const float* scale, const float* bias, \
                     float* y, int N, int n0, int two) {                                          \
    vf acc0[MC], acc1[MC];                                                                        \
    for (int c = 0; c < MC; c++) { acc0[c] = (vf){0}; acc1[c] = (vf){0}; }                        \
    const WT* w0 = wp + packed_at(n0, K);                                                         \
    const WT* w1 = wp + packed_at(n0 + VW, K);                                                    \
    if (two) {                                                                                    \
        for (int k = 0; k < K; k++) {                                                             \
            vf a = LOAD(w0 + (size_t)k * 16), b = LOAD(w1 + (size_t)k * 16);                      \
            for (int c = 0; c < MC; c++) {                                                        \
                float s = x[(size_t)c * K + k];                                                   \
                acc0[c] += a * s;                                                                 \
                acc1[c] += b * s;                                                                 \
            }                                                                                     \
        }                                                                                         \
    } else {                                                                                      \
        for (int k = 0; k < K; k++) {                                                             \
            vf a = LOAD(w0 + (size_t)k * 16);                                                     \
            for (int c = 0; c < MC; c++) acc0[c] += a * x[(size_t)c * K + k];                     \
        }                                                                                         \
    }                                                                                             \
    for (int c = 0; c < MC; c++) {                                                                \
        store_vec(FINISH(acc0[c], scale, n0), bias, y + (size_t)c * N, n0, N);                    \
        if (two) store_vec(FINISH(acc1[c], scale, n0 + VW), bias, y + (size_t)c * N, n0 + VW, N); \
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

/* each thread owns whole tiles of 2 x VW outputs: their weights stay in its cache while every
   input row passes over them (the padded width is a multiple of 16, so only with VW = 16 can a
   last tile have one vector) */
#define RUN_TILES(TILES, WP, SCALE)                                                               \
    int padded = (N + 15) / 16 * 16, ntiles = (padded + 2 * VW - 1) / (2 * VW);                   \
    size_t work = (size_t)M * N * K;                                                              \
    int chunk = PARALLEL_CHUNK(ntiles, threads);                                                  \
    _Pragma("omp parallel for schedule(dynamic, chunk) num_threads(threads) if (work >= PARALLEL_MIN_WORK)") \
    for (int p = 0; p < ntiles; p++) {                                                            \
        int n0 = 2 * VW * p, two = padded - n0 > VW;                                              \
        for (int m0 = 0; m0 < M; m0 += 6) {                                                       \
            int mc = M - m0 < 6 ? M - m0 : 6;                                                     \
            TILES[mc](x + (size_t)m0 * K, K, WP, SCALE, bias, y + (size_t)m0 * N, N, n0, two);    \
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

/* Rows ids[0..n) of a packed fp32 weight wp[ceil(N/16)][K][16] (an embedding lookup): out[n][K].
 * Returns the index of the first id outside [0, N) (nothing of it written), or -1. torch's
 * indexing of the packed layout took three tensor ops, 11-16 µs a step. */
int packed_rows_f32(const float* wp, int N, int K, const int64_t* ids, int n, float* out) {
    for (int i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= N) return i;
        const float* src = wp + (size_t)(id / 16) * K * 16 + id % 16;
        for (int k = 0; k < K; k++) out[(size_t)i * K + k] = src[(size_t)k * 16];
    }
    return -1;
}
