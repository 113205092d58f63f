/* Attention of a few new tokens per row over the KV cache, in place (no gather, no mask).
 *
 * Decode and draft verification attend n (1 to 64) new query tokens per row against that
 * row's whole cache. torch spends more on the plumbing of such small products (the gather of
 * the rows' keys, the causal mask, several ops per layer) than on the arithmetic; here one task
 * per (row, key/value head) reads each key and value once for all of the head's query heads
 * and new tokens:
 *
 *   q   [B * n, hkv * g, D]           the rows' new tokens, row after row (head = h * g + i)
 *   k,v [num_slots, hkv, max_len, D]  one layer's cache (D a multiple of 16)
 *   out [B * n, hkv * g, D]
 *
 * Token j of row r sits at position starts[r] + j and attends keys 0 .. starts[r] + j.
 * Scores are computed 16 queries at a time (the queries transposed, each key's elements
 * broadcast), the softmax runs on those 16 lanes with a vector exp, and the weighted sum of
 * values 4 queries x 16 dims at a time. Each query is summed over keys in order, the same way
 * whatever n and B, and keys past its position weigh exactly 0: a row's result does not depend
 * on the rest of the batch.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int vi16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }
static inline v16 vsel(vi16 mask, v16 a, v16 b) { return (v16)((mask & (vi16)a) | (~mask & (vi16)b)); }

/* exp on 16 lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]) */
static inline v16 vexp(v16 x) {
    x = vsel(x < splat(-87.3f), splat(-87.3f), x);
    x = vsel(x > splat(88.3f), splat(88.3f), x);
    v16 shifted = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) in the low mantissa */
    v16 n = shifted - 12582912.0f;
    vi16 ni = (vi16)shifted - 0x4B400000;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((ni + 127) << 23);
}

void cache_attention_f32(const float* q, const float* k, const float* v, float* out,
                         const int* slots, const int* starts, int B, int n, int hkv, int g, int D,
                         int max_len, float scale, int threads) {
    int hq = hkv * g, nq = n * g, nv = (nq + 15) / 16;
    #pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int task = 0; task < B * hkv; task++) {
        int r = task / hkv, h = task % hkv, start = starts[r], length = start + n;
        const float* kb = k + ((size_t)slots[r] * hkv + h) * max_len * D;
        const float* vb = v + ((size_t)slots[r] * hkv + h) * max_len * D;
        /* query a = j * g + i: token j, head h * g + i */
        float* qt = calloc((size_t)nv * D * 16, sizeof(float));   /* [nv][D][16] */
        float* s = malloc(sizeof(float) * (size_t)nv * length * 16); /* [nv][length][16] */
        float* inv = malloc(sizeof(float) * (size_t)nv * 16);
        for (int a = 0; a < nq; a++) {
            const float* qa = q + ((size_t)(r * n + a / g) * hq + h * g + a % g) * D;
            for (int d = 0; d < D; d++) qt[((size_t)(a / 16) * D + d) * 16 + a % 16] = qa[d];
        }
        for (int blk = 0; blk < nv; blk++) {
            const float* qb = qt + (size_t)blk * D * 16;
            float* sb = s + (size_t)blk * length * 16;
            vi16 limit;  /* keys each lane attends */
            for (int lane = 0; lane < 16; lane++) {
                int a = blk * 16 + lane;
                limit[lane] = a < nq ? start + a / g + 1 : 0;
            }
            v16 top = splat(-3.0e38f);
            for (int t0 = 0; t0 < length; t0 += 4) {
                /* 4 keys at a time: independent accumulators, each query vector loaded once */
                int nt = length - t0 < 4 ? length - t0 : 4;
                const float* kt[4];
                for (int c = 0; c < 4; c++) kt[c] = kb + (size_t)(t0 + (c < nt ? c : 0)) * D;
                v16 acc[4] = {{0}, {0}, {0}, {0}};
                for (int d = 0; d < D; d++) {
                    v16 qd = ld(qb + (size_t)d * 16);
                    for (int c = 0; c < 4; c++) acc[c] += qd * kt[c][d];
                }
                for (int c = 0; c < nt; c++) {
                    int t = t0 + c;
                    v16 sc = acc[c] * scale;
                    vi16 live = (vi16){0} + t < limit;
                    top = vsel(live & (sc > top), sc, top);
                    st(sb + (size_t)t * 16, sc);
                }
            }
            v16 total = {0};
            for (int t = 0; t < length; t++) {
                vi16 live = (vi16){0} + t < limit;
                v16 e = vsel(live, vexp(ld(sb + (size_t)t * 16) - top), (v16){0});
                total += e;
                st(sb + (size_t)t * 16, e);
            }
            for (int lane = 0; lane < 16; lane++) inv[blk * 16 + lane] = total[lane] > 0.f ? 1.f / total[lane] : 0.f;
        }
        /* out[a] = sum_t p[a][t] v[t] / total[a], 4 queries x 16 dims per pass */
        for (int a0 = 0; a0 < nq; a0 += 4) {
            int na = nq - a0 < 4 ? nq - a0 : 4;
            for (int d0 = 0; d0 < D; d0 += 16) {
                v16 acc[4] = {{0}, {0}, {0}, {0}};
                for (int t = 0; t < length; t++) {
                    v16 vt = ld(vb + (size_t)t * D + d0);
                    for (int c = 0; c < na; c++) {
                        int a = a0 + c;
                        acc[c] += s[((size_t)(a / 16) * length + t) * 16 + a % 16] * vt;
                    }
                }
                for (int c = 0; c < na; c++) {
                    int a = a0 + c;
                    float* o = out + ((size_t)(r * n + a / g) * hq + h * g + a % g) * D + d0;
                    st(o, acc[c] * inv[a]);
                }
            }
        }
        free(qt);
        free(s);
        free(inv);
    }
}
