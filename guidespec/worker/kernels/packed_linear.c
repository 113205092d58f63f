/* fp32 linear layers on the CPU over packed weights: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * The weight is packed once, at load, as blocks of 16 output rows: wp[N/16][K][16] holds
 * w[16b + i][k] at [b][k][i] (the last block zero-padded). A tile multiplies up to NV vectors of
 * outputs (4 x VW with AVX-512, 2 x VW with AVX2: below) by up to 6 input rows: per k it loads the
 * weight vectors, broadcasts each row's x[k], and accumulates the products in registers; no
 * horizontal sums, one sequential pass over the weight whatever M is.
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
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "parallel.h"
#include "pool.h"
#include "vec.h"

/* VW outputs from n0 (sum + bias), cut at N. The partial vector's lanes are stored by st(): a
 * memcpy from &acc here kept every tile's accumulators in memory (GCC 12 at -O3: each FMA loaded
 * and stored its accumulator, ~16 GFLOP/s a core where the tiles make 38) */
static inline void store_vec(vf acc, const float* bias, float* y, int n0, int N) {
    if (N - n0 >= VW) {  /* a whole vector: one store (a lane-by-lane one cost as much as the sums at K = 64) */
        st(y + n0, bias ? acc + ld(bias + n0) : acc);
        return;
    }
    float lanes[VW];
    st(lanes, acc);
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

/* The widest tile, in vectors of outputs: with AVX-512's 32 registers 4 x 6 rows = 24
 * accumulators beside the 4 weight vectors and the broadcast (10 loads a k for 24 multiply-adds);
 * AVX2's 16 hold 2 x 6. Tiles of 1, 2 and NV vectors are made: a loop's range of vectors is cut
 * into the widest that fit.
 *
 * Why 4 and not 2 with AVX-512: a batch-64 LM head of the tiny model (49,152 x 64) is compute
 * bound. In a loop of tiles alone (48 rows, one core, Sapphire Rapids) 2 x 6 tiles (8 loads for 12
 * multiply-adds) reached 89-99 GFLOP/s, 4 x 6 106-111, MKL's sgemm 112. Each tile is a function of
 * its own: the 2 x 6 tiles before read a `two` flag at run time, which kept their accumulators in
 * memory, zeroed by `rep stos` at every call (the fused head + picks: ~67 GFLOP/s a core). */
#if VW == 16
#define NV 4
#else
#define NV 2
#endif
#define UNROLL _Pragma("GCC unroll 8")

/* the widest tile within `left` vectors */
static inline int tile_width(int left) { return left >= NV ? NV : left >= 2 ? 2 : 1; }

/* The sums of MC input rows x WIDTH output vectors from n0 in acc[v][c], weights of type WT read by
   LOAD (all sizes compile-time: the accumulators stay in registers) */
#define TILE_SUMS(WIDTH, MC, WT, LOAD)                                                            \
    vf acc[WIDTH][MC];                                                                            \
    const WT* w[WIDTH];                                                                           \
    UNROLL for (int v = 0; v < WIDTH; v++) {                                                      \
        w[v] = wp + packed_at(n0 + v * VW, K);                                                    \
        UNROLL for (int c = 0; c < MC; c++) acc[v][c] = (vf){0};                                  \
    }                                                                                             \
    for (int k = 0; k < K; k++) {                                                                 \
        vf a[WIDTH];                                                                              \
        UNROLL for (int v = 0; v < WIDTH; v++) a[v] = LOAD(w[v] + (size_t)k * 16);                \
        UNROLL for (int c = 0; c < MC; c++) {                                                     \
            float s = x[(size_t)c * K + k];                                                       \
            UNROLL for (int v = 0; v < WIDTH; v++) acc[v][c] += a[v] * s;                         \
        }                                                                                         \
    }

/* NAME_WIDTH_MC: the tile's sums finished by FINISH, plus the bias, stored into y [MC][N];
   NAMEo_WIDTH_MC: the same into out [MC][NV * VW] (lanes past N hold their sums without a bias: the
   picks skip them) */
#define DEFINE_TILE(NAME, WIDTH, MC, WT, LOAD, FINISH)                                            \
static void NAME##_##WIDTH##_##MC(const float* x, int K, const WT* wp, const float* scale,        \
                                  const float* bias, float* y, int N, int n0) {                   \
    TILE_SUMS(WIDTH, MC, WT, LOAD)                                                                \
    UNROLL for (int c = 0; c < MC; c++)                                                           \
        UNROLL for (int v = 0; v < WIDTH; v++)                                                    \
            store_vec(FINISH(acc[v][c], scale, n0 + v * VW), bias, y + (size_t)c * N, n0 + v * VW, N); \
}                                                                                                 \
static void NAME##o_##WIDTH##_##MC(const float* x, int K, const WT* wp, const float* scale,       \
                                   const float* bias, float* out, int N, int n0) {                \
    TILE_SUMS(WIDTH, MC, WT, LOAD)                                                                \
    UNROLL for (int c = 0; c < MC; c++)                                                           \
        UNROLL for (int v = 0; v < WIDTH; v++) {                                                  \
            float* lanes = out + (size_t)c * NV * VW + v * VW;                                    \
            st(lanes, FINISH(acc[v][c], scale, n0 + v * VW));                                     \
            if (bias) store_vec(ld(lanes), bias, lanes - (n0 + v * VW), n0 + v * VW, N);          \
        }                                                                                         \
}
#define DEFINE_WIDTH(NAME, WIDTH, WT, LOAD, FINISH)                                               \
    DEFINE_TILE(NAME, WIDTH, 1, WT, LOAD, FINISH) DEFINE_TILE(NAME, WIDTH, 2, WT, LOAD, FINISH)   \
    DEFINE_TILE(NAME, WIDTH, 3, WT, LOAD, FINISH) DEFINE_TILE(NAME, WIDTH, 4, WT, LOAD, FINISH)   \
    DEFINE_TILE(NAME, WIDTH, 5, WT, LOAD, FINISH) DEFINE_TILE(NAME, WIDTH, 6, WT, LOAD, FINISH)
#define WIDTH_ROW(NAME, WIDTH) {0, NAME##_##WIDTH##_1, NAME##_##WIDTH##_2, NAME##_##WIDTH##_3,     \
                                NAME##_##WIDTH##_4, NAME##_##WIDTH##_5, NAME##_##WIDTH##_6}
/* NAMEs[width][rows] and NAMEos[width][rows]: widths 1 and 2, and NV where it is 4 */
#if NV == 4
#define DEFINE_WIDE(NAME, WT, LOAD, FINISH) DEFINE_WIDTH(NAME, 4, WT, LOAD, FINISH)
#define WIDE_ROW(NAME) , [4] = WIDTH_ROW(NAME, 4)
#else
#define DEFINE_WIDE(NAME, WT, LOAD, FINISH)
#define WIDE_ROW(NAME)
#endif
#define DEFINE_TILES(NAME, WT, LOAD, FINISH)                                                      \
    DEFINE_WIDTH(NAME, 1, WT, LOAD, FINISH) DEFINE_WIDTH(NAME, 2, WT, LOAD, FINISH)               \
    DEFINE_WIDE(NAME, WT, LOAD, FINISH)                                                           \
    static void (*const NAME##s[NV + 1][7])(const float*, int, const WT*, const float*, const float*, float*, int, int) = \
        {[1] = WIDTH_ROW(NAME, 1), [2] = WIDTH_ROW(NAME, 2) WIDE_ROW(NAME)};                      \
    static void (*const NAME##os[NV + 1][7])(const float*, int, const WT*, const float*, const float*, float*, int, int) = \
        {[1] = WIDTH_ROW(NAME##o, 1), [2] = WIDTH_ROW(NAME##o, 2) WIDE_ROW(NAME##o)};
DEFINE_TILES(tile, float, ld, unscaled)
DEFINE_TILES(tileq, signed char, ldq, scaled)

/* A loop over tiles' arguments (the picks' fields only for them) */
typedef struct {
    const float* x;
    const void* wp;
    const float *scale, *bias;
    float* y;
    int M, N, K;
    const int32_t *mask_of_row, *bitmask;
    int W;
    vf* tops;
    vi *firsts, *nans;
    float* scratch;         /* the picks': 6 x K floats a thread */
    const uint8_t* sparse;  /* the picks': rows whose mask allows tokens in few tiles (NULL: none) */
} tiles_args;

/* The loops' items are vectors of outputs (ceil(N / 16) * 16 / VW of them), in chunks of whole
 * widest tiles where PARALLEL_CHUNK's holds one (a batch-64 LM head of 49,152: 48 tiles a chunk),
 * else of two vectors, as the tiles of two were before (a small N has few: a last tile of one
 * vector where their count is odd). Each thread owns whole tiles: their weights stay in its
 * cache while every input row passes over them. */
static inline int vector_chunk(int vectors, int threads) {
    int chunk = PARALLEL_CHUNK(vectors, threads);
    return chunk >= NV ? chunk - chunk % NV : 2;
}

#define DEFINE_RUN(TILES, WT)                                                                     \
static void TILES##_run(void* ctx, int begin, int end, int thread) {                              \
    const tiles_args* a = ctx;                                                                    \
    int M = a->M, N = a->N, K = a->K;                                                             \
    (void)thread;                                                                                 \
    for (int v = begin, width; v < end; v += width) {                                             \
        int n0 = VW * v;                                                                          \
        width = tile_width(end - v);                                                              \
        for (int m0 = 0; m0 < M; m0 += 6) {                                                       \
            int mc = M - m0 < 6 ? M - m0 : 6;                                                     \
            TILES[width][mc](a->x + (size_t)m0 * K, K, (const WT*)a->wp, a->scale, a->bias, a->y + (size_t)m0 * N, N, n0); \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_RUN(tiles, float)
DEFINE_RUN(tileqs, signed char)

#define RUN_TILES(TILES, WP, SCALE)                                                               \
    int vectors = (N + 15) / 16 * 16 / VW;                                                        \
    size_t work = (size_t)M * N * K;                                                              \
    tiles_args a = {x, WP, SCALE, bias, y, M, N, K, 0, 0, 0, 0, 0, 0, 0, 0};                      \
    pool_for(vectors, vector_chunk(vectors, threads), threads, work >= PARALLEL_MIN_WORK, TILES##_run, &a);

void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y,
                       int M, int N, int K, int threads) {
    RUN_TILES(tiles, wp, (const float*)0)
}

/* scale has ceil(N/16)*16 entries (zero-padded like the blocks) */
void packed_linear_i8(const float* x, const signed char* qp, const float* scale, const float* bias, float* y,
                      int M, int N, int K, int threads) {
    RUN_TILES(tileqs, qp, scale)
}

/* Greedy picks without the logits: for each of the M rows of y = x @ w^T + bias (N outputs), the
 * index argmax_rows_f32 (logits_ops.c) gives of it (the first largest among the tokens its mask
 * allows; the first NaN where there is one; 0 where every allowed value is -inf or none is
 * allowed) and whether the row is dead (no NaN and every allowed value -inf). mask_of_row, bitmask
 * and W as there.
 *
 * Why: a greedy decode step of a small-hidden model wrote its [M, N] logits only for the pick to
 * read them back: at 64 rows of 49,152 that is 12.6 MB each way, a fifth of rank 0's step (tiny
 * model: LM head 3.0 ms, pick 0.8). Each tile's sums go to a buffer the size of the tile instead,
 * and each row keeps, per vector lane, its largest value and the first index that held it (what
 * first_max keeps), per thread; a thread's tiles come in increasing order, so merging the threads
 * lane by lane (the larger value; of equal ones the lower index), then the lanes, gives the first
 * largest of the row. The sums are the tiles' own: every value equals the logits' value. */
/* the lanes of the VW tokens index (from n0) that exist and row `words` allows (all where words is NULL) */
static inline vi allowed_lanes(vi index, int n0, int N, const uint32_t* words) {
    vi keep = index < N;
    if (words) keep &= -((((vi){0} + (int)(words[n0 >> 5] >> (n0 & 31))) >> (index - n0)) & 1);
    return keep;
}

static inline void pick_vec(vf v, vi index, int n0, int N, const uint32_t* words, vf* top, vi* first, vi* nan) {
    if (n0 + VW > N || words) {  /* tokens past N, or not allowed: -inf */
        vi keep = allowed_lanes(index, n0, N, words);
        v = (vf)(((vi)v & keep) | ((vi)((vf){0} - INFINITY) & ~keep));
    }
    vi greater = v > *top;  /* (false where either is NaN: a row with a NaN is picked again, pick_nan) */
    *top = (vf)(((vi)v & greater) | ((vi)*top & ~greater));
    *first = (index & greater) | (*first & ~greater);
    *nan |= v != v;
}

/* The row's first allowed NaN (as argmax_rows_f32 picks it), its logits computed again: rare */
#define PICK_NAN(TILES, WP, SCALE, r, words, out)                                                 \
    do {                                                                                          \
        float* y = malloc(sizeof(float) * (size_t)vectors * VW);                                  \
        for (int v = 0; y && v < vectors; v++) TILES[1][1](x + (size_t)(r) * K, K, WP, SCALE, bias, y, N, VW * v); \
        for (int t = 0; y && t < N; t++)                                                          \
            if ((!(words) || ((words)[t >> 5] >> (t & 31)) & 1u) && y[t] != y[t]) { out = t; break; } \
        free(y);                                                                                  \
    } while (0)

/* Whether row r needs the `span` tokens' tile from n0 (a span under 32 divides 32 and its tokens
 * sit in one mask word; a longer one is whole words): a row not marked sparse always does */
static inline int tile_needed(const tiles_args* a, size_t r, int n0, int span) {
    if (!a->sparse[r]) return 1;
    const uint32_t* words = (const uint32_t*)a->bitmask + (size_t)a->mask_of_row[r] * a->W;
    if (span < 32) return ((words[n0 >> 5] >> (n0 & 31)) & ((1u << span) - 1)) != 0;
    for (int i = n0 >> 5; i < (n0 + span) >> 5; i++)
        if (words[i]) return 1;
    return 0;
}

/* Which rows' masks allow tokens in at most a quarter of their words (the tiles skipped for them
 * pay for the checks); NULL where none does. A row is read until more than W / 4 of its words
 * are seen to allow tokens. */
static uint8_t* sparse_rows(const int32_t* mask_of_row, const int32_t* bitmask, int W, int M) {
    if (!mask_of_row) return NULL;
    uint8_t* sparse = NULL;
    for (int r = 0; r < M; r++) {
        if (mask_of_row[r] < 0) continue;
        const int32_t* words = bitmask + (size_t)mask_of_row[r] * W;
        int allowing = 0;
        for (int i0 = 0; i0 < W && allowing <= W / 4; i0 += 64) {  /* (blocks: the count vectorizes) */
            int n = W - i0 < 64 ? W - i0 : 64;
            for (int i = 0; i < n; i++) allowing += words[i0 + i] != 0;
        }
        if (allowing > W / 4) continue;
        if (!sparse && !(sparse = calloc((size_t)M, 1))) return NULL;  /* (no memory: no skipping) */
        sparse[r] = 1;
    }
    return sparse;
}

/* one group's tile (rows[0..mc), their inputs at x) and its picks */
#define PICK_GROUP(OTILES, WT, x)                                                                 \
    do {                                                                                          \
        OTILES[width][mc](x, K, (const WT*)a->wp, a->scale, a->bias, out, N, n0);                 \
        for (int c = 0; c < mc; c++) {                                                            \
            size_t row = (size_t)rows[c];                                                         \
            int mask = a->mask_of_row ? a->mask_of_row[row] : -1;                                 \
            const uint32_t* words = mask >= 0 ? (const uint32_t*)(a->bitmask + (size_t)mask * W) : NULL; \
            vf* top = a->tops + me + row;                                                         \
            vi *first = a->firsts + me + row, *nan = a->nans + me + row;                          \
            for (int u = 0; u < width; u++)                                                       \
                pick_vec(ld(out + (c * NV + u) * VW), lane + (n0 + u * VW), n0 + u * VW, N, words, top, first, nan); \
        }                                                                                         \
    } while (0)

/* a thread's tiles (increasing: pool_for's chunks are) picked into its lane states. Where some rows
 * are sparse (sparse_rows), a tile is computed only for the rows that need it (a guided row between
 * JSON values allows a few dozen tokens of 49,152: ~2% of the LM head), in groups of up to 6 such
 * rows; a group's rows that are not consecutive are copied together first (scratch: 6 x K floats
 * a thread). A tile skipped for a row would only have offered it -inf: its picks are the same. */
#define DEFINE_PICKS(TILES, OTILES, WT)                                                           \
static void TILES##_picks(void* ctx, int begin, int end, int thread) {                            \
    const tiles_args* a = ctx;                                                                    \
    int M = a->M, N = a->N, K = a->K, W = a->W;                                                   \
    size_t me = (size_t)thread * M;                                                               \
    float* xs = a->scratch + (size_t)thread * 6 * K;                                              \
    float out[6 * NV * VW] __attribute__((aligned(64)));                                          \
    int rows[6];                                                                                  \
    vi lane;                                                                                      \
    for (int l = 0; l < VW; l++) lane[l] = l;                                                     \
    for (int v = begin, width; v < end; v += width) {                                             \
        int n0 = VW * v;                                                                          \
        width = tile_width(end - v);                                                              \
        if (!a->sparse) { /* every row needs every tile */                                       \
            for (int m0 = 0; m0 < M; m0 += 6) {                                                   \
                int mc = M - m0 < 6 ? M - m0 : 6;                                                 \
                for (int c = 0; c < mc; c++) rows[c] = m0 + c;                                    \
                PICK_GROUP(OTILES, WT, a->x + (size_t)m0 * K);                                    \
            }                                                                                     \
            continue;                                                                             \
        }                                                                                         \
        for (int r = 0, mc = 0; r < M; r++) {                                                     \
            if (tile_needed(a, (size_t)r, n0, width * VW)) rows[mc++] = r;                        \
            if ((mc < 6 && r < M - 1) || !mc) continue;                                           \
            const float* x = a->x + (size_t)rows[0] * K;                                          \
            if (rows[mc - 1] - rows[0] != mc - 1) { /* not consecutive: gathered */               \
                for (int c = 0; c < mc; c++) memcpy(xs + (size_t)c * K, a->x + (size_t)rows[c] * K, sizeof(float) * K); \
                x = xs;                                                                           \
            }                                                                                     \
            PICK_GROUP(OTILES, WT, x);                                                            \
            mc = 0;                                                                               \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_PICKS(tiles, tileos, float)
DEFINE_PICKS(tileqs, tileqos, signed char)

#define RUN_PICKS(TILES, WP, SCALE)                                                               \
    int vectors = (N + 15) / 16 * 16 / VW;                                                        \
    size_t work = (size_t)M * N * K;                                                              \
    int team = threads > 0 ? threads : 1;                                                         \
    size_t states = (size_t)team * M;                                                             \
    vf* tops = aligned_alloc(sizeof(vf), sizeof(vf) * states); /* (vectors: aligned) */          \
    vi* firsts = aligned_alloc(sizeof(vi), sizeof(vi) * states);                                  \
    vi* nans = aligned_alloc(sizeof(vi), sizeof(vi) * states);                                    \
    float* scratch = malloc(sizeof(float) * 6 * (size_t)K * team);                                \
    if (!tops || !firsts || !nans || !scratch) {                                                  \
        free(tops); free(firsts); free(nans); free(scratch);                                      \
        return -1;                                                                                \
    }                                                                                             \
    for (size_t i = 0; i < states; i++) {                                                         \
        tops[i] = (vf){0} - INFINITY;                                                             \
        firsts[i] = nans[i] = (vi){0};                                                            \
    }                                                                                             \
    uint8_t* sparse = sparse_rows(mask_of_row, bitmask, W, M);                                    \
    tiles_args a = {x, WP, SCALE, bias, 0, M, N, K, mask_of_row, bitmask, W, tops, firsts, nans, scratch, sparse}; \
    pool_for(vectors, vector_chunk(vectors, team), team, work >= PARALLEL_MIN_WORK, TILES##_picks, &a); \
    int failed = 0;                                                                               \
    for (int r = 0; r < M; r++) {                                                                 \
        vf m = tops[r];                                                                           \
        vi at = firsts[r], nan = nans[r];                                                         \
        for (int t = 1; t < team; t++) {  /* lane by lane: the larger value, of equal ones the lower index */ \
            vf v = tops[(size_t)t * M + r];                                                       \
            vi i = firsts[(size_t)t * M + r];                                                     \
            vi take = (v > m) | ((v == m) & (i < at));                                            \
            m = (vf)(((vi)v & take) | ((vi)m & ~take));                                           \
            at = (i & take) | (at & ~take);                                                       \
            nan |= nans[(size_t)t * M + r];                                                       \
        }                                                                                         \
        float top = -INFINITY;                                                                    \
        int pick = N, any_nan = 0;                                                                \
        for (int l = 0; l < VW; l++) {                                                            \
            top = m[l] > top ? m[l] : top;                                                        \
            any_nan |= nan[l];                                                                    \
        }                                                                                         \
        for (int l = 0; l < VW; l++)                                                              \
            if (m[l] == top && at[l] < pick) pick = at[l];                                        \
        if (top == -INFINITY) pick = 0;                                                           \
        if (any_nan) {                                                                            \
            int mask = mask_of_row ? mask_of_row[r] : -1, found = -1;                             \
            const uint32_t* words = mask >= 0 ? (const uint32_t*)(bitmask + (size_t)mask * W) : NULL; \
            PICK_NAN(TILES, WP, SCALE, r, words, found);                                          \
            failed |= found < 0;                                                                  \
            pick = found;                                                                         \
        }                                                                                         \
        best[r] = pick;                                                                           \
        dead[r] = !any_nan && top == -INFINITY;                                                   \
    }                                                                                             \
    free(tops);                                                                                   \
    free(firsts);                                                                                 \
    free(nans);                                                                                   \
    free(scratch);                                                                                \
    free(sparse);                                                                                 \
    return -failed;

int packed_linear_argmax_f32(const float* x, const float* wp, const float* bias, int M, int N, int K,
                             const int32_t* mask_of_row, const int32_t* bitmask, int W, int64_t* best,
                             uint8_t* dead, int threads) {
    RUN_PICKS(tiles, wp, (const float*)0)
}

int packed_linear_argmax_i8(const float* x, const signed char* qp, const float* scale, const float* bias, int M,
                            int N, int K, const int32_t* mask_of_row, const int32_t* bitmask, int W,
                            int64_t* best, uint8_t* dead, int threads) {
    RUN_PICKS(tileqs, qp, scale)
}

/* Greedy picks, as packed_linear_argmax_f32 makes them, from an int8 copy of the weight (qp, scale,
 * sums: weights.py's ``PicksCheck``) and an exact look at the few tokens that could win.
 *
 * Why: one row's LM head reads its whole weight for 2 x K flops a token: 12.6 MB of fp32 for the
 * tiny model's 49,152 x 64, 0.29-0.40 ms on two cores here (6 rows cost 0.35-0.51), most of a
 * batch-1 step; the int8 copy is a quarter of it. At 64 rows the head is compute bound, and AVX-512
 * VNNI's int8 sums (below) are 4x an fp32 FMA's (AVX2's: below).
 *
 * How it stays exact: for each token t, err[t] and err2[t] bound how far its logit from the copy
 * (a_t) can be from the fp32 one, per unit of the row's ||x||_2 and of ||x - x's int8 rounding||_2
 * (the int8 sums'; 0 otherwise): Cauchy-Schwarz over the rows' difference, both sums' rounding and the
 * copy's own. With e_t the bound, L = max over allowed t of a_t - e_t is at most the largest exact
 * logit, and a token with a_t + e_t < L is below it. Each thread, as its tiles' int8 sums come
 * out, keeps its running L and notes each vector of tokens with an allowed a_t + e_t at or above
 * it; after, the vectors noted that reach the final L (a few, for weights and inputs of the usual
 * sizes) are summed again in fp32 by the very tile the exact picks use (the same bits), and the
 * first largest allowed token among them is the pick.
 *
 * No bias (an LM head's). Rows whose mask allows few tiles (sparse_rows) are picked by the exact
 * picks, which skip the rest: cheaper. Returns 0 with best and dead written, or 1 where the
 * exact picks must run instead: every row sparse, an input that is not finite, whose sums could
 * overflow (reach: the weight rows' largest L1 norm) or whose int8 scale could underflow, a row
 * whose mask allows nothing (dead rows are the exact picks'), more than CHECKED_NOTES vectors
 * noted in a row by a thread, or no memory. */
#define CHECKED_NOTES 256
typedef struct {
    int vector;  /* in VW tokens */
    float top;   /* its largest allowed a_t + e_t */
} checked_note;
typedef struct {
    const float* x;
    const signed char* qp;
    const float *scale, *err, *err2;
    const float* block_err;  /* [2][N/16 blocks]: each block's largest err and err2 (AMX's looks) */
    const float *x2, *r2;  /* [M]: each row's ||x||_2, and ||x - its int8 rounding||_2 (0 without int8 sums) */
    const float* emax;     /* [M]: each row's largest bound over every token (checked_floor) */
    int M, N, K, W;
    const int32_t *mask_of_row, *bitmask;
    float* lower;          /* [thread][row]: the running L */
    float* floors;         /* [thread][row]: the coarse looks' floor under it (checked_floor) */
    checked_note* notes;   /* [thread][row][CHECKED_NOTES] */
    int* counts;           /* [thread][row] */
    int* failed;           /* [thread]: too many notes */
    const uint8_t* xq;     /* int8 sums: the inputs as uint8 [M][K4] (OFFSET + x / xscale) */
    const float* xscale;   /* int8 sums: [M] */
    const int32_t* sums;   /* int8 sums: each token's sum of its int8 weights, times OFFSET */
    int K4;                /* int8 sums: K rounded up to 4 */
    int32_t* amx_out;      /* AMX: [thread][16 rows][AMX_ROW] sums */
} checked_args;

/* whether any lane of m is set */
static inline int any_lane(vi m) {
#if VW == 8 && defined(__AVX__)
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#elif VW == 16
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
    int any = 0;
    for (int l = 0; l < VW; l++) any |= m[l] != 0;
    return any;
#endif
}

/* whether any lane of a is at or above b's */
static inline int any_at_least(vf a, vf b) {
#if VW == 16
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GE_OQ) != 0;
#elif VW == 8 && defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GE_OQ)) != 0;
#else
    int any = 0;
    for (int l = 0; l < VW; l++) any |= a[l] >= b[l];
    return any;
#endif
}
static inline float lanes_max(vf a) {
    float m = a[0];
    for (int l = 1; l < VW; l++) m = a[l] > m ? a[l] : m;
    return m;
}
static inline const uint32_t* row_words(const checked_args* a, int r) {
    int mask = a->mask_of_row ? a->mask_of_row[r] : -1;
    return mask >= 0 ? (const uint32_t*)(a->bitmask + (size_t)mask * a->W) : NULL;
}

/* A note of row r's vector of tokens from `at`, whose largest allowed upper bound is top (summed
 * again exactly after: checked_rows); 0 where the thread's notes of the row are full (failed). */
static inline int checked_note_add(const checked_args* a, int thread, int r, int at, float top) {
    int* count = a->counts + (size_t)thread * a->M + r;
    if (*count == CHECKED_NOTES) {
        a->failed[thread] = 1;
        return 0;
    }
    a->notes[((size_t)thread * a->M + r) * CHECKED_NOTES + (*count)++] = (checked_note){at / VW, top};
    return 1;
}

#if VW == 16
/* the lanes of the 16 tokens from `at` (a multiple of 16) below N that row words allows (NULL: all) */
static inline __mmask16 allowed16(const checked_args* a, int at, const uint32_t* words) {
    __mmask16 keep = at + 16 <= a->N ? 0xffff : (__mmask16)((1u << (a->N - at)) - 1);
    return words ? keep & (__mmask16)(words[at >> 5] >> (at & 31)) : keep;
}
#endif

/* A thread's look at row r's approximate logits av of the VW tokens from `at`: its running L
 * (lower), and a note of the vector where an allowed token's upper bound reaches it. No value is
 * NaN or infinite: the inputs are finite, the weights too (weights.py), no sum overflows. */
static inline void checked_look(const checked_args* a, int thread, int r, int at, vf av, vi lane,
                                const uint32_t* words) {
    float* lower = a->lower + (size_t)thread * a->M + r;
    vf e = ((vf){0} + a->x2[r]) * ld(a->err + at) + ((vf){0} + a->r2[r]) * ld(a->err2 + at);
    vf low = av - e, up = av + e;
#if VW == 16  /* (the mask word's 16 bits are the lanes' mask) */
    __mmask16 keep = allowed16(a, at, words);
    __m512 floor = _mm512_set1_ps(*lower);
    __mmask16 rising = _mm512_mask_cmp_ps_mask(keep, (__m512)low, floor, _CMP_GT_OQ);
    if (rising) {  /* (rare once L has grown) */
        float m = _mm512_mask_reduce_max_ps(rising, (__m512)low);
        *lower = m > *lower ? m : *lower;
        floor = _mm512_set1_ps(*lower);
    }
    __mmask16 reach = _mm512_mask_cmp_ps_mask(keep, (__m512)up, floor, _CMP_GE_OQ);
    if (!reach) return;
    float top = _mm512_mask_reduce_max_ps(reach, (__m512)up);
    (void)lane;
#else
    /* (most looks: no token's upper bound reaches L, masked or not, so none's lower bound rises
       above it either) */
    if (!any_at_least(up, (vf){0} + *lower)) return;
    const vf minus_inf = (vf){0} - INFINITY;
    vi keep = allowed_lanes(lane + at, at, a->N, words);
    low = (vf)(((vi)low & keep) | ((vi)minus_inf & ~keep));
    up = (vf)(((vi)up & keep) | ((vi)minus_inf & ~keep));
    if (any_at_least(low, (vf){0} + *lower)) {
        float m = lanes_max(low);
        *lower = m > *lower ? m : *lower;
    }
    if (!any_at_least(up, (vf){0} + *lower)) return;
    float top = lanes_max(up);
#endif
    checked_note_add(a, thread, r, at, top);
}

/* With AVX-512 VNNI the inputs are rounded to int8 too (per row: xscale = max|x| / 127), and each
 * 32-bit lane sums four uint8 x int8 products an instruction (vpdpbusd: 64 multiply-adds against
 * an fp32 FMA's 16), exactly, in int32. The weight is packed for it as qp[N/16][K4/4][16][4]; the
 * uint8 inputs are 128 + x / xscale, the 128 taken off with each token's weight sum. err then
 * also bounds the inputs' rounding (weights.py: ``PicksCheck``). A batch-64 LM head's sums are
 * compute bound: what this is for.
 *
 * With AVX2 alone the same layout and sums take three instructions: vpmaddubsw's int16 sums of
 * two products, vpmaddwd's of two of those into int32, an add. vpmaddubsw saturates at 32767, so
 * the inputs are rounded to 7 bits (xscale = max|x| / 63, uint8 64 + x / xscale: two products
 * reach 2 x 127 x 127 = 32258 at most): exact, the inputs' rounding twice VNNI's, which err2's
 * term bounds as it is. 32 multiply-adds for three instructions against an fp32 FMA's 8: on a
 * Zen 3, two threads, the tiny model's head (49,152 x 64): 64 rows' picks 7.3 -> 2.2 ms (they
 * were the exact fp32 picks past 6 rows), 1 row's 0.25 -> 0.10 (fp32 sums of the copy before).
 * The copy's weights are rounded to 7 bits there (|w| <= 63, CHECKED_WEIGHT_LEVELS): two products
 * reach 2 x 127 x 63 = 16002, so the int16 sums of two groups of 4 k's add before one vpmaddwd
 * widens them (SUM_ADD2): 64 multiply-adds for five instructions, three of them multiplies where
 * there were four; err bounds the coarser copy as it is. Rank 0's mask + sample at 64 rows 1.59 ->
 * 1.41 ms. */
#if (VW == 16 && defined(__AVX512VNNI__)) || (VW == 8 && defined(__AVX2__))
#define CHECKED_INT8 1
#if VW == 16
#define CHECKED_LEVELS 127  /* the inputs' int8 range: [-LEVELS, LEVELS] + OFFSET */
#define CHECKED_OFFSET 128
typedef __m512i vsum;
#define SUM_ZERO _mm512_setzero_si512
#define SUM_LOAD(p) _mm512_loadu_si512(p)
#define SUM_STORE(p, v) _mm512_storeu_si512(p, v)
#define SUM_ADD(acc, s, b) _mm512_dpbusd_epi32(acc, s, b)
#define SUM_ADD2(acc, s, b, s2, b2) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, s, b), s2, b2)
#define CHECKED_WEIGHT_LEVELS 127
#define SUM_BROADCAST _mm512_set1_epi32
#define SUM_SUB _mm512_sub_epi32
#define SUM_FLOAT _mm512_cvtepi32_ps
#else
#define CHECKED_LEVELS 63
#define CHECKED_OFFSET 64
typedef __m256i vsum;
#define SUM_ZERO _mm256_setzero_si256
#define SUM_LOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define SUM_STORE(p, v) _mm256_storeu_si256((__m256i*)(p), v)
#define SUM_ADD(acc, s, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(s, b), _mm256_set1_epi16(1)))
/* two groups of 4 k's: their int16 pair sums added before they are widened (|w| <= 63: no overflow) */
#define SUM_ADD2(acc, s, b, s2, b2)                                                                   \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(s, b), _mm256_maddubs_epi16(s2, b2)), \
                                            _mm256_set1_epi16(1)))
#define CHECKED_WEIGHT_LEVELS 63
#define SUM_BROADCAST _mm256_set1_epi32
#define SUM_SUB _mm256_sub_epi32
#define SUM_FLOAT _mm256_cvtepi32_ps
#endif
/* the sums of MC input rows by WIDTH vectors of VW tokens from n0: vector v's VW tokens are a
   block's (16's) first or second half, its 4 k's VW x 4 bytes at the block's group of 16 x 4 */
#define VNNI_SUMS(WIDTH, MC)                                                                      \
static void vnni_##WIDTH##_##MC(const uint8_t* xq, int K4, const signed char* qp, int n0, int32_t* out) { \
    vsum acc[WIDTH][MC];                                                                          \
    const signed char* w[WIDTH];                                                                  \
    UNROLL for (int v = 0; v < WIDTH; v++) {                                                      \
        int t = n0 + v * VW;                                                                      \
        w[v] = qp + (size_t)(t / 16) * K4 * 16 + t % 16 * 4;                                      \
        UNROLL for (int c = 0; c < MC; c++) acc[v][c] = SUM_ZERO();                               \
    }                                                                                             \
    int j = 0;                                                                                    \
    for (; j + 8 <= K4; j += 8) {  /* (two groups of 4 k's a pass: SUM_ADD2) */                   \
        UNROLL for (int c = 0; c < MC; c++) {                                                     \
            int32_t four, next;                                                                   \
            memcpy(&four, xq + (size_t)c * K4 + j, 4);                                            \
            memcpy(&next, xq + (size_t)c * K4 + j + 4, 4);                                        \
            vsum s = SUM_BROADCAST(four), s2 = SUM_BROADCAST(next);                               \
            UNROLL for (int v = 0; v < WIDTH; v++)                                                \
                acc[v][c] = SUM_ADD2(acc[v][c], s, SUM_LOAD(w[v] + (size_t)j * 16), s2,           \
                                     SUM_LOAD(w[v] + (size_t)(j + 4) * 16));                      \
        }                                                                                         \
    }                                                                                             \
    for (; j < K4; j += 4) {                                                                      \
        vsum b[WIDTH];                                                                            \
        UNROLL for (int v = 0; v < WIDTH; v++) b[v] = SUM_LOAD(w[v] + (size_t)j * 16);           \
        UNROLL for (int c = 0; c < MC; c++) {                                                     \
            int32_t four;                                                                         \
            memcpy(&four, xq + (size_t)c * K4 + j, 4);                                            \
            vsum s = SUM_BROADCAST(four);                                                         \
            UNROLL for (int v = 0; v < WIDTH; v++) acc[v][c] = SUM_ADD(acc[v][c], s, b[v]);       \
        }                                                                                         \
    }                                                                                             \
    UNROLL for (int c = 0; c < MC; c++)                                                           \
        UNROLL for (int v = 0; v < WIDTH; v++) SUM_STORE(out + (c * NV + v) * VW, acc[v][c]);     \
}
#define VNNI_WIDTH(WIDTH) VNNI_SUMS(WIDTH, 1) VNNI_SUMS(WIDTH, 2) VNNI_SUMS(WIDTH, 3) VNNI_SUMS(WIDTH, 4) \
    VNNI_SUMS(WIDTH, 5) VNNI_SUMS(WIDTH, 6)
#define VNNI_ROW(WIDTH) {0, vnni_##WIDTH##_1, vnni_##WIDTH##_2, vnni_##WIDTH##_3, vnni_##WIDTH##_4, \
                         vnni_##WIDTH##_5, vnni_##WIDTH##_6}
VNNI_WIDTH(1) VNNI_WIDTH(2)
#if NV == 4
VNNI_WIDTH(4)
#endif
static void (*const vnnis[NV + 1][7])(const uint8_t*, int, const signed char*, int, int32_t*) = {
    [1] = VNNI_ROW(1), [2] = VNNI_ROW(2),
#if NV == 4
    [4] = VNNI_ROW(4),
#endif
};

/* row r's int8 logits of the tile's vector u from `at` (out: the tile's int32 sums) */
static inline vf checked_values(const checked_args* a, const int32_t* out, int c, int u, int at, int r) {
    vsum i = SUM_SUB(SUM_LOAD(out + (c * NV + u) * VW), SUM_LOAD(a->sums + at));
    return (vf)SUM_FLOAT(i) * a->xscale[r] * ld(a->scale + at);
}
typedef int32_t checked_sum;
#else
#define CHECKED_INT8 0
#define CHECKED_LEVELS 127
#define CHECKED_WEIGHT_LEVELS 127
#define CHECKED_OFFSET 0
/* without int8 sums (VNNI's or AVX2's) the int8 weight is widened to fp32 in the tiles (tileqos): out holds the logits */
static inline vf checked_values(const checked_args* a, const float* out, int c, int u, int at, int r) {
    (void)a, (void)at, (void)r;
    return ld(out + (c * NV + u) * VW);
}
typedef float checked_sum;
#endif

/* With AMX (Sapphire Rapids on), the same int8 sums in tiles: a TDPBSSD multiplies 16 rows of 64
 * int8 inputs by 64 x 16 int8 weights into 16 x 16 int32 sums, 16x a vpdpbusd's work an
 * instruction at a sixteenth of its rate. VNNI's layout is AMX's: a 16-token block's K4/4 groups
 * of 16 x 4 bytes are a B tile's rows. The inputs are signed here (no 128 to take off: the same
 * integer sums). At batch 64 of the tiny model's head (49,152 x 64) the checked picks took
 * 1.6-1.9 -> 1.15-1.46 ms on one thread, 0.9-1.2 -> 0.63-0.80 on two (scratch runs, min of 15-40).
 *
 * A thread takes its blocks of tokens AMX_SPAN at a time: for each 16 rows, the span's sums are
 * stored (a row's contiguous) and then looked at row by row, with the row's running L in
 * registers (checked_span). Looking at each 16 x 16 tile as it was stored cost more than the sums
 * did: every look reloaded its row's state. Only where K is whole chunks of 64 (no partial tile)
 * and for AMX_MIN_ROWS rows or more; rows are padded to 16 with zeros (xq's rows past M, whose
 * sums nothing reads). Linux hands a process AMX's state on request (arch_prctl); where it
 * refuses, VNNI's sums run. */
#if CHECKED_INT8 && VW == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CHECKED_AMX 1
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_SPAN 16  /* blocks of 16 tokens (at most 16: checked_span): 16 rows' sums in 17 KB, within L1 (64: slower) */
#define AMX_MIN_ROWS 8  /* (fewer: VNNI's sums, unpadded; 1-2 rows took them 0.10-0.15 ms against AMX's 0.15-0.16) */
#define AMX_ROW (AMX_SPAN * 16 + 16)  /* int32s a row's sums take (padded: rows a power of two apart share L1 sets) */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_config;
static int amx_granted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_request(void) { amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0; }
static int amx_off;
static int amx_available(void) {
    pthread_once(&amx_once, amx_request);
    return amx_granted && !amx_off;
}
/* every tile 16 rows of 64 bytes: 0-3 sums (C), 4 and 7 inputs (A), 5 and 6 weights (B) */
static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* Row r's looks at its int8 logits' sums of `vectors` (<= 16) blocks from token n0 (sums:
 * [vectors][16] int32, the inputs signed: no offset to take off), checked_look's with its state
 * in registers: the lanes' running maxima of a_t - E, whose largest is L (broadcast every 4
 * vectors: a vector compared with a lower L is noted where it need not be, never missed). E is
 * the block's bound, from its tokens' largest err and err2 (block_err): at least each token's
 * e_t (the same roundings of larger terms), so L is still at most the largest exact logit and no
 * token within e_t of it is missed; a bound a block, not a token, saves two loads and two
 * products a look (a few more vectors noted). */
static void checked_span(const checked_args* a, int thread, int r, int n0, int vectors, const int32_t* sums) {
    float* lower = a->lower + (size_t)thread * a->M + r;
    const uint32_t* words = row_words(a, r);
    __m512 xscale = _mm512_set1_ps(a->xscale[r]);
    __m512 floor = _mm512_set1_ps(*lower), lows = floor;
    float bound[16] __attribute__((aligned(64)));
    __mmask16 blocks = (__mmask16)((1u << vectors) - 1);
    const float* block_err = a->block_err + n0 / 16;
    size_t stride = (size_t)(a->N + 15) / 16;
    _mm512_store_ps(bound, _mm512_fmadd_ps(_mm512_set1_ps(a->x2[r]), _mm512_maskz_loadu_ps(blocks, block_err),
                                           _mm512_mul_ps(_mm512_set1_ps(a->r2[r]),
                                                         _mm512_maskz_loadu_ps(blocks, block_err + stride))));
    for (int u = 0; u < vectors; u++) {
        int at = n0 + 16 * u;
        __m512 av = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * u)), xscale),
                                  _mm512_loadu_ps(a->scale + at));
        __m512 e = _mm512_set1_ps(bound[u]);
        __mmask16 keep = allowed16(a, at, words);
        lows = _mm512_mask_max_ps(lows, keep, lows, _mm512_sub_ps(av, e));
        __mmask16 reach = _mm512_mask_cmp_ps_mask(keep, _mm512_add_ps(av, e), floor, _CMP_GE_OQ);
        if (u % 4 == 3) floor = _mm512_set1_ps(_mm512_reduce_max_ps(lows));
        if (reach && !checked_note_add(a, thread, r, at, _mm512_mask_reduce_max_ps(reach, _mm512_add_ps(av, e))))
            return;
    }
    *lower = _mm512_reduce_max_ps(lows);
}

/* the sums of 16 rows (A tile `at`, their inputs from x) by `blocks` (up to 4) blocks of weights
   from w into C tiles 0-3, the chunks of 64 inputs in turn */
#define AMX_BLOCK(c, at, bt)                                                                       \
    if (blocks > c) {                                                                             \
        _tile_loadd(bt, w + (size_t)(c) * K4 * 16 + (size_t)k * 16, 64);                          \
        _tile_dpbssd(c, at, bt);                                                                  \
    }
#define AMX_SUMS(at)                                                                              \
    for (int k = 0; k < K4; k += 64) {                                                            \
        if (K4 > 64) _tile_loadd(at, x + k, K4);                                                  \
        AMX_BLOCK(0, at, 5) AMX_BLOCK(1, at, 6) AMX_BLOCK(2, at, 5) AMX_BLOCK(3, at, 6)                      \
    }
static void checked_run_amx(void* ctx, int begin, int end, int thread) {
    const checked_args* a = ctx;
    int M = a->M, K4 = a->K4;
    int32_t* out = a->amx_out + (size_t)thread * 16 * AMX_ROW;
    size_t stride = AMX_ROW * 4;  /* bytes: a row's span of sums */
    amx_configure();
    for (int v0 = begin; v0 < end; v0 += AMX_SPAN) {  /* (VW == 16: a vector is a block of 16 tokens) */
        int span = end - v0 < AMX_SPAN ? end - v0 : AMX_SPAN;
        for (int m0 = 0; m0 < M; m0 += 16) {
            const uint8_t* x = a->xq + (size_t)m0 * K4;
            if (K4 == 64) _tile_loadd(4, x, K4);  /* (one chunk: the rows' inputs stay in their tile) */
            for (int u = 0; u < span; u += 4) {
                int blocks = span - u < 4 ? span - u : 4;
                const signed char* w = a->qp + (size_t)(v0 + u) * K4 * 16;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                if (K4 > 64 && (u / 4) % 2) {  /* (the inputs' tile alternates: a load waits for the reads of its tile) */
                    AMX_SUMS(7)
                } else {
                    AMX_SUMS(4)
                }
                int32_t* o = out + (size_t)u * 16;
                _tile_stored(0, o, stride);
                if (blocks > 1) _tile_stored(1, o + 16, stride);
                if (blocks > 2) _tile_stored(2, o + 32, stride);
                if (blocks > 3) _tile_stored(3, o + 48, stride);
            }
            int rows = M - m0 < 16 ? M - m0 : 16;
            for (int r = 0; r < rows && !a->failed[thread]; r++)
                checked_span(a, thread, m0 + r, 16 * v0, span, out + (size_t)r * AMX_ROW);
        }
    }
    _tile_release();
}
#define CHECKED_AMX_RUN checked_run_amx
#else
#define CHECKED_AMX 0
#define CHECKED_AMX_RUN checked_run
#define AMX_SPAN 1
#define AMX_ROW 1
#define AMX_MIN_ROWS 1
static int amx_available(void) { return 0; }
#endif

/* The coarse look before checked_look's: row r's value of the tile's vector u in units that need
 * no bound per token (with int8 sums the logit over the row's xscale), against checked_floor's:
 * L less the row's largest bound over every token (emax), with a slack far above the roundings'
 * difference between the two looks. A vector none of whose tokens reaches it cannot reach L in
 * checked_look (so none raises L either); the rest (a few, once L has grown) are looked at again.
 * A look that needs no err, err2 or mask: about half the instructions of checked_look's. */
#if CHECKED_INT8
static inline vf checked_coarse(const checked_args* a, const int32_t* out, int c, int u, int at) {
    vsum i = SUM_SUB(SUM_LOAD(out + (c * NV + u) * VW), SUM_LOAD(a->sums + at));
    return (vf)SUM_FLOAT(i) * ld(a->scale + at);
}
static inline float checked_floor(const checked_args* a, int r, float lower) {
    return (lower - a->emax[r] - (fabsf(lower) + a->emax[r]) * 0x1p-16f) / a->xscale[r];
}
#else
static inline vf checked_coarse(const checked_args* a, const float* out, int c, int u, int at) {
    (void)a, (void)at;
    return ld(out + (c * NV + u) * VW);
}
static inline float checked_floor(const checked_args* a, int r, float lower) {
    return lower - a->emax[r] - (fabsf(lower) + a->emax[r]) * 0x1p-16f;
}
#endif

/* a thread's tiles of the int8 copy, each vector of each row looked at as it comes out: the whole
 * tile coarsely first (one branch for its rows' vectors), then checked_look where a vector may reach
 * L. On a Zen 3 (AVX2), 64 rows of the tiny model's head: rank 0's mask + sample 1.92 -> 1.60 ms. */
static void checked_run(void* ctx, int begin, int end, int thread) {
    const checked_args* a = ctx;
    int M = a->M;
    checked_sum out[6 * NV * VW] __attribute__((aligned(64)));
    vi lane;
    for (int l = 0; l < VW; l++) lane[l] = l;
    for (int v = begin, width; v < end; v += width) {
        int n0 = VW * v;
        width = tile_width(end - v);
        for (int m0 = 0; m0 < M; m0 += 6) {
            int mc = M - m0 < 6 ? M - m0 : 6;
#if CHECKED_INT8
            vnnis[width][mc](a->xq + (size_t)m0 * a->K4, a->K4, a->qp, n0, out);
#else
            tileqos[width][mc](a->x + (size_t)m0 * a->K, a->K, a->qp, a->scale, (const float*)0, out, a->N, n0);
#endif
            float* floors = a->floors + (size_t)thread * M + m0;
            vi reach = (vi){0};  /* a lane set where some row's token of it reaches its floor */
            for (int c = 0; c < mc; c++) {
                vf floor = (vf){0} + floors[c];
                for (int u = 0; u < width; u++) reach |= (vi)(checked_coarse(a, out, c, u, n0 + u * VW) >= floor);
            }
            if (!any_lane(reach)) continue;  /* (most tiles, once L has grown) */
            for (int c = 0; c < mc; c++) {
                vf floor = (vf){0} + floors[c];
                for (int u = 0; u < width; u++) {
                    int at = n0 + u * VW;
                    if (!any_at_least(checked_coarse(a, out, c, u, at), floor)) continue;
                    int r = m0 + c;
                    const float* lower = a->lower + (size_t)thread * M + r;
                    float seen = *lower;
                    checked_look(a, thread, r, at, checked_values(a, out, c, u, at, r), lane, row_words(a, r));
                    if (*lower != seen) floors[c] = checked_floor(a, r, *lower), floor = (vf){0} + floors[c];
                }
            }
        }
    }
}

/* Whether the checked picks sum in AMX's tiles (where K is whole chunks of 64): built for them,
 * granted by Linux, and not turned off. `use`: 0 turns them off, 1 on again, -1 asks. */
int packed_checked_amx(int use) {
#if CHECKED_AMX
    if (use >= 0) amx_off = !use;
#else
    (void)use;
#endif
    return amx_available();
}

/* Which int8 layout packed_linear_argmax_checked reads: the uint8 inputs' offset (128 with VNNI,
 * 64 with AVX2's maddubs) where it sums int8 inputs, in VNNI's layout (qp[N/16][K4/4][16][4], with
 * each token's weight sum times the offset); 0, the tiles' (qp[N/16][K][16]) */
int packed_checked_offset(void) { return CHECKED_OFFSET; }

/* The int8 copy's largest level (its scale per token: the row's largest magnitude over it): 63 with
 * AVX2's maddubs, whose int16 sums of two groups of 4 k's then cannot overflow (SUM_ADD2), else 127 */
int packed_checked_weight_levels(void) { return CHECKED_WEIGHT_LEVELS; }

/* the checked picks of rows none of which is sparse (packed_linear_argmax_checked's) */
static int checked_rows(const float* x, const float* wp, const signed char* qp, const float* scale,
                        const int32_t* sums, const float* err, const float* err2, const float* block_err, float reach,
                        int M, int N, int K,
                        const int32_t* mask_of_row, const int32_t* bitmask, int W, int64_t* best, uint8_t* dead,
                        int threads) {
    int team = threads > 0 ? threads : 1, K4 = (K + 3) / 4 * 4;
    size_t states = (size_t)team * M;
    float* figures = malloc(sizeof(float) * 4 * (size_t)M);  /* xscale, x2, r2, emax */
    float* lower = malloc(sizeof(float) * 2 * states);  /* lower, then floors */
    int* counts = calloc(states, sizeof(int));
    int* failed = calloc((size_t)team, sizeof(int));
    checked_note* notes = malloc(sizeof(checked_note) * states * CHECKED_NOTES);
    int amx = CHECKED_AMX && K % 64 == 0 && M >= AMX_MIN_ROWS && amx_available();
    size_t padded = amx ? (size_t)(M + 15) / 16 * 16 : (size_t)M;  /* (AMX's tiles: rows of zeros past M) */
    uint8_t* xq = CHECKED_INT8 ? calloc(padded, K4) : NULL;
    int32_t* amx_out = amx ? aligned_alloc(64, sizeof(int32_t) * team * 16 * AMX_ROW) : NULL;
    int settled = figures && lower && counts && failed && notes && (xq || !CHECKED_INT8) && (amx_out || !amx);
    float *xscale = figures, *x2 = figures ? figures + M : NULL, *r2 = figures ? figures + 2 * M : NULL;
    float* emax = figures ? figures + 3 * M : NULL;
    checked_args a = {x, qp, scale, err, err2, block_err, x2, r2, emax, M, N, K, W, mask_of_row, bitmask, lower,
                      lower ? lower + states : NULL, notes, counts, failed, xq, xscale, sums, K4, amx_out};
    float most = 0.f, most2 = 0.f;  /* every token's largest err and err2 (their blocks') */
    for (int b = 0, blocks = (N + 15) / 16; b < blocks; b++) {
        most = block_err[b] > most ? block_err[b] : most;
        most2 = block_err[blocks + b] > most2 ? block_err[blocks + b] : most2;
    }
    for (int r = 0; settled && r < M; r++) {
        float m = 0.f;
        for (int k = 0; k < K; k++) {
            float v = x[(size_t)r * K + k];
            settled &= v == v;
            m = fmaxf(m, fabsf(v));
        }
        /* (finite, no sum may overflow, and no int8 scale of VNNI's underflows) */
        settled &= m * reach <= 1e37f && m <= 1e30f && (m == 0 || m >= 1e-30f);
        double squares = 0, residue = 0;  /* (in double: exact to far below the float rounding up) */
        for (int k = 0; k < K; k++) squares += (double)x[(size_t)r * K + k] * x[(size_t)r * K + k];
        if (xq) {  /* (|x / xscale| < LEVELS: rounded, in [-LEVELS, LEVELS]) */
            xscale[r] = m > 0 ? m * (1.0f / CHECKED_LEVELS) * (1 + 0x1p-20f) : 1.f;
            for (int k = 0; k < K4; k++) {
                int rounded = k < K ? (int)lrintf(x[(size_t)r * K + k] / xscale[r]) : 0;
                xq[(size_t)r * K4 + k] = (uint8_t)(amx ? rounded : CHECKED_OFFSET + rounded);  /* (AMX's sums are signed) */
                double off = k < K ? (double)x[(size_t)r * K + k] - (double)xscale[r] * rounded : 0.0;
                residue += off * off;
            }
        }
        x2[r] = nextafterf((float)(sqrt(squares) * (1 + 0x1p-40)), INFINITY);
        r2[r] = residue > 0 ? nextafterf((float)(sqrt(residue) * (1 + 0x1p-40)), INFINITY) : 0.f;
        emax[r] = (x2[r] * most + r2[r] * most2) * (1 + 0x1p-20f);
    }
    if (settled) {
        for (size_t i = 0; i < 2 * states; i++) lower[i] = -INFINITY;  /* (and the floors) */
        int vectors = (N + 15) / 16 * 16 / VW;
        pool_for(vectors, vector_chunk(vectors, team), team, (size_t)M * N * K >= PARALLEL_MIN_WORK,
                 amx ? CHECKED_AMX_RUN : checked_run, &a);
        for (int t = 0; t < team; t++) settled &= !failed[t];
    }
    float out[NV * VW] __attribute__((aligned(64)));
    vi lane;
    for (int l = 0; l < VW; l++) lane[l] = l;
    for (int r = 0; settled && r < M; r++) {
        float bound = -INFINITY, top = -INFINITY;
        for (int t = 0; t < team; t++) bound = lower[(size_t)t * M + r] > bound ? lower[(size_t)t * M + r] : bound;
        const uint32_t* words = row_words(&a, r);
        int64_t pick = -1;
        for (int t = 0; bound > -INFINITY && t < team; t++) {
            const checked_note* noted = notes + ((size_t)t * M + r) * CHECKED_NOTES;
            for (int i = 0; i < counts[(size_t)t * M + r]; i++) {
                if (noted[i].top < bound) continue;
                int n0 = noted[i].vector * VW;
                vi keep = allowed_lanes(lane + n0, n0, N, words);
                tileos[1][1](x + (size_t)r * K, K, wp, (const float*)0, (const float*)0, out, N, n0);
                for (int l = 0; l < VW; l++) {
                    if (!keep[l]) continue;
                    if (out[l] != out[l]) settled = 0;  /* (a NaN: the exact picks' rules) */
                    if (out[l] > top || (out[l] == top && n0 + l < pick) || pick < 0) top = out[l], pick = n0 + l;
                }
            }
        }
        if (pick < 0) settled = 0;  /* nothing allowed */
        best[r] = pick;
        dead[r] = 0;
    }
    free(figures);
    free(lower);
    free(counts);
    free(failed);
    free(notes);
    free(xq);
    free(amx_out);
    return settled ? 0 : 1;
}

int packed_linear_argmax_checked(const float* x, const float* wp, const signed char* qp, const float* scale,
                                 const int32_t* sums, const float* err, const float* err2, const float* block_err,
                                 float reach, int M, int N,
                                 int K, const int32_t* mask_of_row, const int32_t* bitmask, int W, int64_t* best,
                                 uint8_t* dead, int threads) {
    if (M < 1) return 1;
    uint8_t* sparse = sparse_rows(mask_of_row, bitmask, W, M);
    if (!sparse)
        return checked_rows(x, wp, qp, scale, sums, err, err2, block_err, reach, M, N, K, mask_of_row, bitmask, W, best, dead,
                            threads);
    /* a batch of both (a JSON row between values beside unguided ones): the dense rows checked,
       the sparse ones by the exact picks, which skip the tiles their masks forbid */
    int dense = 0;
    for (int r = 0; r < M; r++) dense += !sparse[r];
    float* xs = dense ? malloc(sizeof(float) * (size_t)M * K) : NULL;
    int32_t* masks = xs ? malloc(sizeof(int32_t) * (size_t)M) : NULL;
    int* order = masks ? malloc(sizeof(int) * (size_t)M) : NULL;
    int64_t* picks = order ? malloc(sizeof(int64_t) * (size_t)M) : NULL;
    uint8_t* deads = picks ? malloc((size_t)M) : NULL;
    int settled = deads != NULL;
    for (int r = 0, d = 0, f = dense; settled && r < M; r++) {  /* the dense rows first, in order */
        int at = sparse[r] ? f++ : d++;
        order[at] = r;
        masks[at] = mask_of_row[r];
        memcpy(xs + (size_t)at * K, x + (size_t)r * K, sizeof(float) * K);
    }
    settled = settled && checked_rows(xs, wp, qp, scale, sums, err, err2, block_err, reach, dense, N, K, masks, bitmask, W, picks,
                                      deads, threads) == 0;
    settled = settled && packed_linear_argmax_f32(xs + (size_t)dense * K, wp, NULL, M - dense, N, K, masks + dense,
                                                  bitmask, W, picks + dense, deads + dense, threads) == 0;
    for (int i = 0; settled && i < M; i++) {
        best[order[i]] = picks[i];
        dead[order[i]] = deads[i];
    }
    free(sparse);
    free(xs);
    free(masks);
    free(order);
    free(picks);
    free(deads);
    return settled ? 0 : 1;
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
