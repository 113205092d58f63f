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
 * Scores are computed VW queries at a time (VW: the machine's vector width, vec.h; the queries
 * transposed, each key's elements broadcast), the softmax runs on those VW lanes with a vector
 * exp, and the weighted sum of values 4 queries x VW dims at a time. Each query is summed over
 * keys in order, the same way whatever n, B and VW are, and keys past its position weigh
 * exactly 0: a row's result does not depend on the rest of the batch.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp on VW lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]) */
static inline vf vexp(vf x) {
    x = vsel(x < splat(-87.3f), splat(-87.3f), x);
    x = vsel(x > splat(88.3f), splat(88.3f), x);
    vf shifted = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) in the low mantissa */
    vf n = shifted - 12582912.0f;
    vi ni = (vi)shifted - 0x4B400000;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((ni + 127) << 23);
}

/* contraction into FMAs off: GCC contracts the same expression differently in different
   places of this function (with 8-wide vectors a query's result then changed with its lane),
   and a token's attention must not depend on the batch */
__attribute__((optimize("fp-contract=off")))
void cache_attention_f32(const float* q, const float* k, const float* v, float* out,
                         const int* slots, const int* starts, int B, int n, int hkv, int g, int D,
                         int max_len, float scale, int threads) {
    int hq = hkv * g, nq = n * g, nv = (nq + VW - 1) / VW;
    #pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int task = 0; task < B * hkv; task++) {
        int r = task / hkv, h = task % hkv, start = starts[r], length = start + n;
        const float* kb = k + ((size_t)slots[r] * hkv + h) * max_len * D;
        const float* vb = v + ((size_t)slots[r] * hkv + h) * max_len * D;
        /* query a = j * g + i: token j, head h * g + i */
        float* qt = calloc((size_t)nv * D * VW, sizeof(float));   /* [nv][D][VW] */
        float* s = malloc(sizeof(float) * (size_t)nv * length * VW); /* [nv][length][VW] */
        float* inv = malloc(sizeof(float) * (size_t)nv * VW);
        for (int a = 0; a < nq; a++) {
            const float* qa = q + ((size_t)(r * n + a / g) * hq + h * g + a % g) * D;
            for (int d = 0; d < D; d++) qt[((size_t)(a / VW) * D + d) * VW + a % VW] = qa[d];
        }
        for (int blk = 0; blk < nv; blk++) {
            const float* qb = qt + (size_t)blk * D * VW;
            float* sb = s + (size_t)blk * length * VW;
            vi limit;  /* keys each lane attends */
            for (int lane = 0; lane < VW; lane++) {
                int a = blk * VW + lane;
                limit[lane] = a < nq ? start + a / g + 1 : 0;
            }
            vf top = splat(-3.0e38f);
            for (int t0 = 0; t0 < length; t0 += 4) {
                /* 4 keys at a time: independent accumulators, each query vector loaded once */
                int nt = length - t0 < 4 ? length - t0 : 4;
                const float* kt[4];
                for (int c = 0; c < 4; c++) kt[c] = kb + (size_t)(t0 + (c < nt ? c : 0)) * D;
                vf acc[4] = {{0}, {0}, {0}, {0}};
                for (int d = 0; d < D; d++) {
                    vf qd = ld(qb + (size_t)d * VW);
                    for (int c = 0; c < 4; c++) acc[c] += qd * kt[c][d];
                }
                for (int c = 0; c < nt; c++) {
                    int t = t0 + c;
                    vf sc = acc[c] * scale;
                    vi live = (vi){0} + t < limit;
                    top = vsel(live & (sc > top), sc, top);
                    st(sb + (size_t)t * VW, sc);
                }
            }
            vf total = {0};
            for (int t = 0; t < length; t++) {
                vi live = (vi){0} + t < limit;
                vf e = vsel(live, vexp(ld(sb + (size_t)t * VW) - top), (vf){0});
                total += e;
                st(sb + (size_t)t * VW, e);
            }
            for (int lane = 0; lane < VW; lane++) inv[blk * VW + lane] = total[lane] > 0.f ? 1.f / total[lane] : 0.f;
        }
        /* out[a] = sum_t p[a][t] v[t] / total[a], 4 queries x VW dims per pass */
        for (int a0 = 0; a0 < nq; a0 += 4) {
            int na = nq - a0 < 4 ? nq - a0 : 4;
            for (int d0 = 0; d0 < D; d0 += VW) {
                vf acc[4] = {{0}, {0}, {0}, {0}};
                for (int t = 0; t < length; t++) {
                    vf vt = ld(vb + (size_t)t * D + d0);
                    for (int c = 0; c < na; c++) {
                        int a = a0 + c;
                        acc[c] += s[((size_t)(a / VW) * length + t) * VW + a % VW] * vt;
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
