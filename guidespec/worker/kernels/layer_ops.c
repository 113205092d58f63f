/* A decoder layer's small operations, each one call instead of several torch ops: the residual
 * add with the RMS norm after it, rotary embedding with the key/value cache write, and the
 * gated MLP's activation.
 *
 * Why: at batch 1 a layer's arithmetic outside its matmuls and attention is a few thousand
 * floats, and torch spends ~10 us of dispatch on each op of it: 30 layers of the default model
 * spent 3.5 ms of a 10 ms decode step there. Each row (token) is computed on its own, in a fixed
 * order, whatever the rest of the batch is.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "parallel.h"
#include "pool.h"
#include "vmath.h"

typedef struct {
    const float *x, *delta, *w;
    float eps, *x_out, *h;
    int H;
} norm_args;

static void norm_rows(void* ctx, int begin, int end, int thread) {
    const norm_args* a = ctx;
    int H = a->H;
    (void)thread;
    for (int t = begin; t < end; t++) {
        const float* xt = a->x + (size_t)t * H;
        float* ht = a->h + (size_t)t * H;
        if (a->delta) {
            float* xo = a->x_out + (size_t)t * H;
            const float* dt = a->delta + (size_t)t * H;
            for (int i = 0; i < H; i++) xo[i] = xt[i] + dt[i];
            xt = xo;
        }
        v8 squares = {0};
        int i = 0;
        for (; i + 8 <= H; i += 8) {
            v8 v = load(xt + i);
            squares += v * v;
        }
        float sum = 0.f;
        for (int c = 0; c < 8; c++) sum += squares[c];
        for (; i < H; i++) sum += xt[i] * xt[i];
        float r = 1.f / sqrtf(sum / (float)H + a->eps);
        for (i = 0; i < H; i++) ht[i] = xt[i] * r * a->w[i];
    }
}

/* x_out = x + delta (delta NULL: x as it is, x_out untouched); h = x_out / rms(x_out) * w.
   x, delta, x_out, h: [T][H] */
void add_rms_norm_f32(const float* x, const float* delta, const float* w, float eps, float* x_out, float* h, int T,
                      int H, int threads) {
    norm_args a = {x, delta, w, eps, x_out, h, H};
    pool_for(T, PARALLEL_CHUNK(T, threads), threads, T >= 32, norm_rows, &a);
}

/* x [D] rotated at one position (cos, sin [D], half-rotation layout as Hugging Face Llama) into out */
static inline void rotate(const float* x, const float* cos, const float* sin, int D, float* out) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        out[i] = a * cos[i] - b * sin[i];
        out[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

typedef struct {
    const float* qkv;
    int hq, hkv, D;
    const float *cos, *sin;
    const int64_t *positions, *rows;
    float *k_cache, *v_cache;
    int block_size, num_blocks;
    float* q_out;
} rope_args;

static void rope_rows(void* ctx, int begin, int end, int thread) {
    const rope_args* a = ctx;
    int hq = a->hq, hkv = a->hkv, D = a->D;
    (void)thread;
    for (int t = begin; t < end; t++) {
        const float* row = a->qkv + (size_t)t * (hq + 2 * hkv) * D;
        int64_t pos = a->positions[t];
        const float *c = a->cos + (size_t)pos * D, *s = a->sin + (size_t)pos * D;
        for (int h = 0; h < hq; h++) rotate(row + (size_t)h * D, c, s, D, a->q_out + ((size_t)t * hq + h) * D);
        for (int h = 0; h < hkv; h++) {
            size_t at = ((size_t)h * a->num_blocks * a->block_size + (size_t)a->rows[t]) * D;
            rotate(row + (size_t)(hq + h) * D, c, s, D, a->k_cache + at);
            const float* vh = row + (size_t)(hq + hkv + h) * D;
            for (int i = 0; i < D; i++) a->v_cache[at + i] = vh[i];
        }
    }
}

/* qkv [T][(hq + 2 hkv) D] (q heads, k heads, v heads): q rotated into q_out [T][hq][D]; k rotated
   and v copied into the caches [hkv][num_blocks][block_size][D] at cache row rows[t] (block
   rows[t] / block_size, offset rows[t] % block_size, of each head's blocks); cos, sin [max_len][D]
   at positions[t] */
void rope_cache_f32(const float* qkv, int T, int hq, int hkv, int D, const float* cos, const float* sin,
                    const int64_t* positions, const int64_t* rows, float* k_cache, float* v_cache, int block_size,
                    int num_blocks, float* q_out, int threads) {
    rope_args a = {qkv, hq, hkv, D, cos, sin, positions, rows, k_cache, v_cache, block_size, num_blocks, q_out};
    pool_for(T, PARALLEL_CHUNK(T, threads), threads, T >= 32, rope_rows, &a);
}

typedef struct {
    const float* gate_up;
    int I;
    float* out;
} silu_args;

static void silu_rows(void* ctx, int begin, int end, int thread) {
    const silu_args* a = ctx;
    int I = a->I;
    (void)thread;
    for (int t = begin; t < end; t++) {
        const float *g = a->gate_up + (size_t)t * 2 * I, *u = g + I;
        float* o = a->out + (size_t)t * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            v8 x = load(g + i);
            store(o + i, x / (1.f + vexp(-x)) * load(u + i));
        }
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* out [T][I] = silu(gate) * up, gate_up [T][2 I] (gate | up) */
void silu_mul_f32(const float* gate_up, int T, int I, float* out, int threads) {
    silu_args a = {gate_up, I, out};
    pool_for(T, PARALLEL_CHUNK(T, threads), threads, T >= 32, silu_rows, &a);
}
