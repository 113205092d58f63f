/* Attention of a few new tokens per row over the KV cache, in place (no gather, no mask).
 *
 * Decode and draft verification attend a few new query tokens per row against that row's whole
 * cache, a prefill chunk many. torch spends more on the plumbing of such small products (the gather of
 * the rows' keys, the causal mask, several ops per layer) than on the arithmetic; here one task
 * per (row, key/value head, 16 new tokens) reads the head's keys and values in place for those
 * tokens' query heads:
 *
 *   q   [B * n, hkv * g, D]                the rows' new tokens, row after row (head = h * g + i)
 *   k,v [hkv, num_blocks, block_size, D]   one layer's cache in blocks (D a multiple of 16), a
 *                                          head's blocks together (consecutive blocks of a head
 *                                          are one run of memory, read as a stream)
 *   out [B * n, hkv * g, D]
 *
 * Token j of row r sits at position starts[r] + j and attends keys 0 .. starts[r] + j, or with a
 * sliding window (window > 0) only the last `window` of them: keys starts[r] + j - window + 1 ..
 * starts[r] + j (Mistral's and Gemma's windowed layers; the keys before are never read). The key at
 * position p of row r is in block tables[r * width + p / block_size], at p % block_size: a row's
 * keys need not be contiguous (a paged cache), only each block's. block_size is a multiple of 8
 * (KEYS), or the row's whole length (one block a row: the cache by slot).
 *
 * A score is a dot product over D: 8 dims to a vector (the query held in registers, the key
 * streamed), and 8 keys' vectors are summed across their lanes together (a transpose by
 * horizontal adds), so a score costs D/8 FMAs and about one add. The softmax runs on vectors of
 * 8 keys with a vector exp; the weighted sum of values on vectors of 8 dims, 3 queries and 64
 * dims at a time. Decoding has few queries per key head (g, 3 for SmolLM2), so spreading the queries
 * over the lanes would leave most of them empty.
 *
 * Each query's score, softmax and sum run over its own keys in order, the same way whatever n,
 * B and the other queries are: a token's attention does not depend on the rest of the batch, nor
 * on how its prompt was cut into prefill chunks (so speculative greedy output equals plain
 * greedy output whatever the steps held).
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_AVX2 1
#endif

enum { KEYS = 8, QUERIES_PER_PASS = 3, KEY_TILE = 64, CHUNK_TOKENS = 16 };

#include "parallel.h"
#include "pool.h"
#include "vmath.h"

/* s[t0 .. t0 + 7] = scale * q . k_t for 8 keys from kt (D floats each) */
static inline __attribute__((always_inline)) v8 scores8(const float* q, const float* kt, int D, float scale) {
#if ATTN_AVX2
    __m256 p[KEYS];
    for (int c = 0; c < KEYS; c++) {
        const float* key = kt + (size_t)c * D;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(key));
        for (int d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(key + d), acc);
        p[c] = acc;
    }
    /* lanes of key c summed into lane c */
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    v8 out;
    memcpy(&out, &sums, sizeof out);
    return out * scale;
#else
    v8 out;
    for (int c = 0; c < KEYS; c++) {
        float acc = 0.f;
        for (int d = 0; d < D; d++) acc += q[d] * kt[(size_t)c * D + d];
        out[c] = acc;
    }
    return out * scale;
#endif
}

static inline v8 fma8(v8 a, v8 b, v8 c) {
#if ATTN_AVX2
    __m256 x, y, z;
    memcpy(&x, &a, 32); memcpy(&y, &b, 32); memcpy(&z, &c, 32);
    x = _mm256_fmadd_ps(x, y, z);
    memcpy(&a, &x, 32);
    return a;
#else
    return a * b + c;
#endif
}

/* acc[c][0 .. dims) += the sum over t in [t0, t1) within [lo[c], length[c]) of w[c][t] * v[t][0 .. dims)
   (value t in block table[t / bs] of the head's blocks v, at t % bs, rows D apart; acc rows D
   apart), in order of t */
static inline __attribute__((always_inline)) void weighted_sum(const float* v, const int* table, int bs, int D,
                                                               const float* const* w, const int* lo,
                                                               const int* length, int t0, int t1, int na, int dims,
                                                               float* const* acc_out) {
    v8 acc[QUERIES_PER_PASS][8];
    for (int c = 0; c < na; c++)
        for (int i = 0; i < dims / 8; i++) acc[c][i] = load(acc_out[c] + 8 * i);
    int blk = t0 / bs, off = t0 % bs;  /* walked along, not divided per key */
    const float* vb = v + (size_t)table[blk] * bs * D;
    for (int t = t0; t < t1; t++, off++) {
        if (off == bs) {
            off = 0;
            vb = v + (size_t)table[++blk] * bs * D;
        }
        const float* vt = vb + (size_t)off * D;
        for (int c = 0; c < na; c++) {
            if (t >= length[c] || t < lo[c]) continue;
            v8 wt = splat(w[c][t]);
            for (int i = 0; i < dims / 8; i++) acc[c][i] = fma8(wt, load(vt + 8 * i), acc[c][i]);
        }
    }
    for (int c = 0; c < na; c++)
        for (int i = 0; i < dims / 8; i++) store(acc_out[c] + 8 * i, acc[c][i]);
}

/* queries a0 .. a0 + nq - 1 of row r, key/value head h (see cache_attention_f32) */
static void attend(const float* q, const float* k, const float* v, const int* table, float* out, int r, int h,
                   int start, int n, int a0, int nq, int hkv, int g, int D, int bs, int num_blocks, float scale,
                   int window) {
    int hq = hkv * g;
    size_t head = (size_t)h * num_blocks * bs * D;  /* head h's blocks */
    k += head;
    v += head;
    int last = start + (a0 + nq - 1) / g + 1;  /* keys the chunk's last query attends */
    int blocks = (last + KEYS - 1) / KEYS, padded = blocks * KEYS;
    /* query a0 + a = j * g + i: token j, head h * g + i; p[a] its weights over the keys */
    /* the task's buffers in one allocation (a decode step of 64 rows of the tiny model runs 256
       tasks) */
    size_t floats = (size_t)nq * padded + KEYS * (size_t)nq + (size_t)nq * D + (size_t)nq;
    float* p = malloc(sizeof(float) * floats + 2 * sizeof(int) * (size_t)nq);
    float* top = p + (size_t)nq * padded;
    float* acc = top + KEYS * (size_t)nq;
    float* inv = acc + (size_t)nq * D;
    int* length = (int*)(inv + nq);
    int* lo = length + nq;  /* query a's first key: 0, or its window's first */
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int a = 0; a < nq; a++) {
        length[a] = start + (a0 + a) / g + 1;
        lo[a] = window > 0 && length[a] > window ? length[a] - window : 0;
        store(top + KEYS * a, splat(-3.0e38f));
    }
    /* scores, KEY_TILE keys for every query at a time (they stay in L1) */
    for (int b0 = lo[0] / KEYS; b0 < blocks; b0 += KEY_TILE / KEYS) {  /* (query 0 reaches back furthest) */
        for (int a = 0; a < nq; a++) {
            const float* qa = q + ((size_t)(r * n + (a0 + a) / g) * hq + h * g + (a0 + a) % g) * D;
            int b1 = (length[a] + KEYS - 1) / KEYS;
            b1 = b1 < b0 + KEY_TILE / KEYS ? b1 : b0 + KEY_TILE / KEYS;
            v8 best = load(top + KEYS * a);
            for (int b = b0 > lo[a] / KEYS ? b0 : lo[a] / KEYS; b < b1; b++) {
                int off = b * KEYS % bs;
                const float* kt = k + ((size_t)table[b * KEYS / bs] * bs + off) * D;
                v8 sc;
                if (off + KEYS <= bs) {
                    sc = D == 64   ? scores8(qa, kt, 64, scale)
                         : D == 16 ? scores8(qa, kt, 16, scale)
                         : D == 32 ? scores8(qa, kt, 32, scale)
                                   : scores8(qa, kt, D, scale);
                } else {  /* a block's last keys (one block a row): not a whole vector of them to read */
                    sc = splat(-3.0e38f);
                    for (int c = 0; c < KEYS && b * KEYS + c < length[a]; c++) {
                        float dot = 0.f;
                        for (int d = 0; d < D; d++) dot += qa[d] * kt[(size_t)c * D + d];
                        sc[c] = dot * scale;
                    }
                }
                v8i key = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + b * KEYS;
                sc = vsel((key < length[a]) & (key >= lo[a]), sc, splat(-3.0e38f));
                best = vsel(sc > best, sc, best);
                store(p + (size_t)a * padded + (size_t)b * KEYS, sc);
            }
            store(top + KEYS * a, best);
        }
    }
    for (int a = 0; a < nq; a++) {
        float* pa = p + (size_t)a * padded;
        v8 best = load(top + KEYS * a), total = {0};
        float m = best[0];
        for (int c = 1; c < KEYS; c++) m = best[c] > m ? best[c] : m;
        for (int b = lo[a] / KEYS; b < (length[a] + KEYS - 1) / KEYS; b++) {
            v8i key = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + b * KEYS;
            v8 e = vsel((key < length[a]) & (key >= lo[a]), vexp(load(pa + (size_t)b * KEYS) - m), (v8){0});
            total += e;
            store(pa + (size_t)b * KEYS, e);
        }
        float sum = 0.f;
        for (int c = 0; c < KEYS; c++) sum += total[c];
        inv[a] = sum > 0.f ? 1.f / sum : 0.f;
    }
    /* out[a] = sum_t p[a][t] v[t] / total[a]: 3 queries x 64 dims at a time, KEY_TILE keys for
       every query at a time, each query's sum over its own keys in order */
    for (int t0 = lo[0]; t0 < last; t0 += KEY_TILE) {
        int t1 = t0 + KEY_TILE < last ? t0 + KEY_TILE : last;
        for (int c0 = 0; c0 < nq; c0 += QUERIES_PER_PASS) {
            int na = nq - c0 < QUERIES_PER_PASS ? nq - c0 : QUERIES_PER_PASS;
            const float* w[QUERIES_PER_PASS];
            float* o[QUERIES_PER_PASS];
            for (int d0 = 0; d0 < D; d0 += 64) {
                int dims = D - d0 < 64 ? D - d0 : 64;
                for (int c = 0; c < na; c++) {
                    w[c] = p + (size_t)(c0 + c) * padded;
                    o[c] = acc + (size_t)(c0 + c) * D + d0;
                }
                /* (sizes the compiler knows: the accumulators stay in registers. A head of 16 or
                   32 dims, or 2 queries a pass (2 query heads a key head), took the general path
                   and its accumulators went through memory: attention was 57% of the tiny
                   model's batch-64 forward on one thread, py-spy) */
#define WEIGHTED_SUM(NA, DIMS) weighted_sum(v + d0, table, bs, D, w, lo + c0, length + c0, t0, t1, NA, DIMS, o)
#define BY_QUERIES(DIMS) (na == 3 ? WEIGHTED_SUM(3, DIMS) : na == 2 ? WEIGHTED_SUM(2, DIMS) : WEIGHTED_SUM(1, DIMS))
                if (dims == 64)
                    BY_QUERIES(64);
                else if (dims == 32)
                    BY_QUERIES(32);
                else if (dims == 16)
                    BY_QUERIES(16);
                else
                    weighted_sum(v + d0, table, bs, D, w, lo + c0, length + c0, t0, t1, na, dims, o);
#undef BY_QUERIES
#undef WEIGHTED_SUM
            }
        }
    }
    for (int a = 0; a < nq; a++) {
        float* o = out + ((size_t)(r * n + (a0 + a) / g) * hq + h * g + (a0 + a) % g) * D;
        for (int d = 0; d < D; d += 8) store(o + d, load(acc + (size_t)a * D + d) * inv[a]);
    }
    free(p);
}

typedef struct {
    const float *q, *k, *v;
    float* out;
    const int *tables, *starts;
    int width, n, hkv, g, D, block_size, num_blocks, window, chunks;
    float scale;
} attention_args;

static void attend_tasks(void* ctx, int begin, int end, int thread) {
    const attention_args* a = ctx;
    int hkv = a->hkv, chunks = a->chunks, n = a->n, g = a->g;
    (void)thread;
    for (int task = begin; task < end; task++) {
        int r = task / (hkv * chunks), h = task / chunks % hkv, chunk = task % chunks;
        int j0 = chunk * CHUNK_TOKENS, tokens = n - j0 < CHUNK_TOKENS ? n - j0 : CHUNK_TOKENS;
        attend(a->q, a->k, a->v, a->tables + (size_t)r * a->width, a->out, r, h, a->starts[r], n, j0 * g, tokens * g,
               hkv, g, a->D, a->block_size, a->num_blocks, a->scale, a->window);
    }
}

void cache_attention_f32(const float* q, const float* k, const float* v, float* out,
                         const int* tables, int width, const int* starts, int B, int n, int hkv, int g, int D,
                         int block_size, int num_blocks, float scale, int window, int threads) {
    /* tasks: (row, key/value head, chunk of CHUNK_TOKENS tokens' queries): a prefill chunk's
       queries spread over the threads, and their weights over the keys take bounded memory */
    int chunks = (n + CHUNK_TOKENS - 1) / CHUNK_TOKENS;
    size_t work = 0;  /* query-key products and their weighted values, roughly */
    for (int r = 0; r < B; r++) work += (size_t)(starts[r] + n) * n * g * hkv * 2 * D;
    attention_args a = {q, k, v, out, tables, starts, width, n, hkv, g, D, block_size, num_blocks, window, chunks,
                        scale};
    pool_for(B * hkv * chunks, 1, threads, work >= PARALLEL_MIN_WORK, attend_tasks, &a);
}
