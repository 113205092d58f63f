/* A whole decoder stack in one call: every layer of a CPU forward at tensor parallel size 1,
 * for a batch whose rows all run the same number of new tokens (decode, draft verification).
 *
 * Why: the layer's kernels (linear layers, attention, the layer ops) are C already, and at
 * batch 1 the Python between them cost ~2.5 ms of a 7 ms decode step of the default model (30
 * layers x 9 calls through ctypes and torch). Here they run in the same order on the same
 * buffers, so the result is the Python loop's bit for bit (LlamaModel.forward picks this path
 * where it applies and the loop elsewhere; a test holds them equal).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LINEAR_F32 = 0, LINEAR_I8 = 1, LINEAR_GGUF = 2 };

typedef struct {
    int kind, format, n, k;  /* format: the GGUF kernel's (gguf_linear.c) */
    const void *a, *b, *c;   /* f32: packed blocks; i8: blocks, scales; gguf: qs, s0, s1 */
    const float* bias;       /* or NULL */
} linear_t;

typedef struct {
    const float *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    float *k_cache, *v_cache;  /* [hkv][num_blocks][block_size][D] */
    int window;                /* the layer's sliding window, 0: none (see attention.c) */
} layer_t;

void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y, int M, int N, int K, int threads);
void packed_linear_i8(const float* x, const signed char* qp, const float* scale, const float* bias, float* y, int M,
                      int N, int K, int threads);
void gguf_linear(const float* x, const uint8_t* qs, const void* s0, const void* s1, int format, const float* bias,
                 float* y, int M, int N, int K, int threads);
void cache_attention_f32(const float* q, const float* k, const float* v, float* out, const int* tables,
                         int width, const int* starts, int B, int n, int hkv, int g, int D, int block_size,
                         int num_blocks, float scale, int window, int threads);
void add_rms_norm_f32(const float* x, const float* delta, const float* w, float eps, float* x_out, float* h, int T,
                      int H, int threads);
void rope_cache_f32(const float* qkv, int T, int hq, int hkv, int D, const float* cos, const float* sin,
                    const int64_t* positions, const int64_t* rows, float* k_cache, float* v_cache, int block_size,
                    int num_blocks, float* q_out, int threads);
void silu_mul_f32(const float* gate_up, int T, int I, float* out, int threads);

static void linear(const linear_t* w, const float* x, float* y, int M, int threads) {
    switch (w->kind) {
        case LINEAR_F32: packed_linear_f32(x, w->a, w->bias, y, M, w->n, w->k, threads); break;
        case LINEAR_I8: packed_linear_i8(x, w->a, w->b, w->bias, y, M, w->n, w->k, threads); break;
        default: gguf_linear(x, w->a, w->b, w->c, w->format, w->bias, y, M, w->n, w->k, threads); break;
    }
}

/* x [T][H]: the embeddings in, the last layer's residual stream out; hidden [T][H]: after the
   final norm. Rows r = 0 .. B-1 run n tokens each (T = B n) from position row_starts[r], their
   cache blocks in tables[r * width ..] (blocks of block_size positions); positions and cache
   rows (block * block_size + offset) [T] per token. */
void decoder_forward_f32(float* x, int T, int H, const layer_t* layers, int num_layers, const float* final_norm,
                         float eps, int hq, int hkv, int D, int I, const float* cos, const float* sin,
                         const int64_t* positions, const int64_t* token_rows, const int* tables, int width,
                         const int* row_starts, int B, int n, int block_size, int num_blocks, float scale,
                         float* hidden,
                         int threads) {
    size_t qkv_width = (size_t)(hq + 2 * hkv) * D;
    float* h = malloc(sizeof(float) * (size_t)T * H);
    float* qkv = malloc(sizeof(float) * (size_t)T * qkv_width);
    float* q = malloc(sizeof(float) * (size_t)T * hq * D);
    float* attn = malloc(sizeof(float) * (size_t)T * hq * D);
    float* delta = malloc(sizeof(float) * (size_t)T * H);
    float* gate_up = malloc(sizeof(float) * (size_t)T * 2 * I);
    float* act = malloc(sizeof(float) * (size_t)T * I);
    for (int i = 0; i < num_layers; i++) {
        const layer_t* layer = &layers[i];
        add_rms_norm_f32(x, i ? delta : NULL, layer->input_norm, eps, x, h, T, H, threads);
        linear(&layer->qkv, h, qkv, T, threads);
        rope_cache_f32(qkv, T, hq, hkv, D, cos, sin, positions, token_rows, layer->k_cache, layer->v_cache, block_size,
                       num_blocks, q, threads);
        cache_attention_f32(q, layer->k_cache, layer->v_cache, attn, tables, width, row_starts, B, n, hkv, hq / hkv,
                            D, block_size, num_blocks, scale, layer->window, threads);
        linear(&layer->o, attn, delta, T, threads);
        add_rms_norm_f32(x, delta, layer->post_norm, eps, x, h, T, H, threads);
        linear(&layer->gate_up, h, gate_up, T, threads);
        silu_mul_f32(gate_up, T, I, act, threads);
        linear(&layer->down, act, delta, T, threads);
    }
    add_rms_norm_f32(x, num_layers ? delta : NULL, final_norm, eps, x, hidden, T, H, threads);
    free(h);
    free(qkv);
    free(q);
    free(attn);
    free(delta);
    free(gate_up);
    free(act);
}
