/* Linear layers over GGUF's own quantized blocks: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * The weight stays row-major as the file stores it, each row K/32 blocks of 32 inputs (the
 * formats below; gguf_weights.py repacks the K-quants into them exactly). Activations are
 * quantized the way llama.cpp's Q8_1 dot products take them: per row and block of 32, a scale
 * d = max|x| / 127, int8 values q = round(x / d) and their sum times d. A block's dot product is
 * then integer (4-bit or 8-bit weights x int8) and scaled in fp32:
 *
 *   sum_i w_i x_i ~ dw * dx * sum_i qw_i qx_i + mw * (dx * sum_i qx_i)      (w_i = dw qw_i + mw)
 *
 * Why: decoding streams every weight once per token. Q4_1 blocks are 20 bytes per 32 weights
 * against 128 in fp32, so the step reads ~6x fewer bytes; the integer products run 32 to an
 * instruction (AVX2 maddubs, or AVX-512 VNNI's dpbusd where the build has it).
 *
 * Each thread owns whole groups of 16 output rows; within a group, up to 4 activation rows at
 * once pass over two weight rows (their blocks unpacked once for all 4, each activation block
 * loaded once for both), so the group's weights stay in L1 while the activations stream: 1 to
 * 4 rows (decode, verification) cost about what one costs, and prefill-sized M reads each
 * weight from cache, not memory. A row's result does not depend on the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { QK = 32, ROWS_PER_GROUP = 16, MAX_TILE = 4 };
enum { FMT_Q4_1 = 0, FMT_Q4F = 1, FMT_Q8_0 = 2, FMT_Q8H = 3 };

typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;  /* ggml's Q4_1 (and Q4_0, as m = -8 d) */
typedef struct { float d, m; uint8_t qs[16]; } block_q4f;      /* Q4_K per 32 inputs: d = d*scale, m = -dmin*min */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;      /* ggml's Q8_0 */
typedef struct { float d[2]; int8_t qs[32]; } block_q8h;       /* Q6_K per 32 inputs: a scale per 16 */

/* the four nibble formats put input j < 16 in qs[j]'s low nibble and input j + 16 in its high one */

static inline float fp16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---------------------------------------------------------------- activations */

typedef struct {
    int8_t* q;  /* [M][K] */
    float* d;   /* [M][K/32]: the block's scale */
    float* s;   /* [M][K/32]: d * the sum of the block's q */
} act_t;

static void quantize_rows(const float* x, int M, int K, act_t* a) {
    int nb = K / QK;
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float* xb = x + (size_t)r * K + b * QK;
            float amax = 0.f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int8_t* q = a->q + (size_t)r * K + b * QK;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = (int8_t)lrintf(xb[i] * id);
                sum += q[i];
            }
            a->d[(size_t)r * nb + b] = d;
            a->s[(size_t)r * nb + b] = d * (float)sum;
        }
    }
}

/* ---------------------------------------------------------------- one block, per format
 * Each format gives its 32 quants (unsigned 0..15 or signed int8), a scale per half block
 * (lo: inputs 0-15, hi: 16-31) and an offset per input (mw, 0 where there is none). */

#define NIBBLES(q, qs) for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
static inline void q4_1_scalar(const void* p, int* q, float* lo, float* hi, float* m) {
    const block_q4_1* b = p; NIBBLES(q, b->qs); *lo = *hi = fp16(b->d); *m = fp16(b->m);
}
static inline void q4f_scalar(const void* p, int* q, float* lo, float* hi, float* m) {
    const block_q4f* b = p; NIBBLES(q, b->qs); *lo = *hi = b->d; *m = b->m;
}
static inline void q8_0_scalar(const void* p, int* q, float* lo, float* hi, float* m) {
    const block_q8_0* b = p; for (int j = 0; j < 32; j++) q[j] = b->qs[j]; *lo = *hi = fp16(b->d); *m = 0.f;
}
static inline void q8h_scalar(const void* p, int* q, float* lo, float* hi, float* m) {
    const block_q8h* b = p; for (int j = 0; j < 32; j++) q[j] = b->qs[j]; *lo = b->d[0]; *hi = b->d[1]; *m = 0.f;
}

#if defined(__AVX2__)
/* 8 int32 lanes, lane i the sum of products 4i..4i+3 of unsigned w and signed x */
static inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
static inline __m256i nibbles(const uint8_t* qs) {
    __m128i t = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), mask), _mm_and_si128(t, mask));
}
/* quants, lane scales (lanes 0-3: inputs 0-15, 4-7: inputs 16-31), offset, signedness */
#define Q4_1_V(p) nibbles(((const block_q4_1*)(p))->qs)
#define Q4_1_S(p) _mm256_set1_ps(fp16(((const block_q4_1*)(p))->d))
#define Q4_1_M(p) fp16(((const block_q4_1*)(p))->m)
#define Q4F_V(p) nibbles(((const block_q4f*)(p))->qs)
#define Q4F_S(p) _mm256_set1_ps(((const block_q4f*)(p))->d)
#define Q4F_M(p) (((const block_q4f*)(p))->m)
#define Q8_0_V(p) _mm256_loadu_si256((const __m256i*)((const block_q8_0*)(p))->qs)
#define Q8_0_S(p) _mm256_set1_ps(fp16(((const block_q8_0*)(p))->d))
#define Q8H_V(p) _mm256_loadu_si256((const __m256i*)((const block_q8h*)(p))->qs)
#define Q8H_S(p) _mm256_set_m128(_mm_set1_ps(((const block_q8h*)(p))->d[1]), _mm_set1_ps(((const block_q8h*)(p))->d[0]))
#define NO_M(p) 0.f

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* NAME##MC: two weight rows (nb blocks of BT each) by MC activation rows, sharing each
   activation block's load; signed quants go through maddubs/dpbusd as |w| times x with w's sign */
#define QTILE_ROW(SIGNED, HAS_M, q, qa, sc, m, c, x, dx, s, acc, macc)                          \
    {                                                                                         \
        __m256i xs = SIGNED ? _mm256_sign_epi8(x, q) : x;                                     \
        __m256 p = _mm256_cvtepi32_ps(dot_u8s8(qa, xs));                                      \
        acc[c] = _mm256_fmadd_ps(p, _mm256_mul_ps(sc, dx), acc[c]);                           \
        if (HAS_M) macc[c] += m * (s);                                                        \
    }
#define DEFINE_QTILE(NAME, MC, BT, QV, QS, QM, SIGNED, HAS_M)                                   \
static void NAME##MC(const void* row0, const void* row1, const act_t* a, int m0, int K,         \
                     float* out0, float* out1) {                                              \
    int nb = K / QK;                                                                          \
    const BT *w0 = row0, *w1 = row1;                                                          \
    __m256 acc0[MC], acc1[MC];                                                                \
    float macc0[MC], macc1[MC];                                                               \
    for (int c = 0; c < MC; c++) {                                                            \
        acc0[c] = acc1[c] = _mm256_setzero_ps();                                              \
        macc0[c] = macc1[c] = 0.f;                                                            \
    }                                                                                         \
    for (int b = 0; b < nb; b++) {                                                            \
        __m256i q0 = QV(w0 + b), qa0 = SIGNED ? _mm256_sign_epi8(q0, q0) : q0;                \
        __m256i q1 = QV(w1 + b), qa1 = SIGNED ? _mm256_sign_epi8(q1, q1) : q1;                \
        __m256 sc0 = QS(w0 + b), sc1 = QS(w1 + b);                                            \
        float mw0 = QM(w0 + b), mw1 = QM(w1 + b);                                             \
        for (int c = 0; c < MC; c++) {                                                        \
            size_t at = (size_t)(m0 + c) * nb + b;                                            \
            __m256i x = _mm256_loadu_si256((const __m256i*)(a->q + at * QK));                 \
            __m256 dx = _mm256_set1_ps(a->d[at]);                                             \
            float s = HAS_M ? a->s[at] : 0.f;                                                 \
            QTILE_ROW(SIGNED, HAS_M, q0, qa0, sc0, mw0, c, x, dx, s, acc0, macc0)             \
            QTILE_ROW(SIGNED, HAS_M, q1, qa1, sc1, mw1, c, x, dx, s, acc1, macc1)             \
        }                                                                                     \
    }                                                                                         \
    for (int c = 0; c < MC; c++) {                                                            \
        out0[c] = hsum(acc0[c]) + macc0[c];                                                   \
        out1[c] = hsum(acc1[c]) + macc1[c];                                                   \
    }                                                                                         \
}
#define DEFINE_QTILES(NAME, BT, QV, QS, QM, SIGNED, HAS_M)                                     \
    DEFINE_QTILE(NAME, 1, BT, QV, QS, QM, SIGNED, HAS_M)                                      \
    DEFINE_QTILE(NAME, 2, BT, QV, QS, QM, SIGNED, HAS_M)                                      \
    DEFINE_QTILE(NAME, 3, BT, QV, QS, QM, SIGNED, HAS_M)                                      \
    DEFINE_QTILE(NAME, 4, BT, QV, QS, QM, SIGNED, HAS_M)
DEFINE_QTILES(q4_1_tile, block_q4_1, Q4_1_V, Q4_1_S, Q4_1_M, 0, 1)
DEFINE_QTILES(q4f_tile, block_q4f, Q4F_V, Q4F_S, Q4F_M, 0, 1)
DEFINE_QTILES(q8_0_tile, block_q8_0, Q8_0_V, Q8_0_S, NO_M, 1, 0)
DEFINE_QTILES(q8h_tile, block_q8h, Q8H_V, Q8H_S, NO_M, 1, 0)
#endif

typedef void (*tile_fn)(const void*, const void*, const act_t*, int, int, float*, float*);
typedef void (*block_fn)(const void*, int*, float*, float*, float*);

/* the portable tile: the same sums in plain C (any MC up to MAX_TILE) */
static void scalar_tile(block_fn unpack, size_t block_bytes, const void* row, const act_t* a, int m0, int mc, int K,
                        float* out) {
    int nb = K / QK, q[QK];
    for (int c = 0; c < mc; c++) out[c] = 0.f;
    for (int b = 0; b < nb; b++) {
        float lo, hi, m;
        unpack((const char*)row + b * block_bytes, q, &lo, &hi, &m);
        for (int c = 0; c < mc; c++) {
            size_t at = (size_t)(m0 + c) * nb + b;
            const int8_t* x = a->q + at * QK;
            int s0 = 0, s1 = 0;
            for (int j = 0; j < 16; j++) { s0 += q[j] * x[j]; s1 += q[j + 16] * x[j + 16]; }
            out[c] += a->d[at] * (lo * (float)s0 + hi * (float)s1) + m * a->s[at];
        }
    }
}

typedef struct {
    size_t block_bytes;
    block_fn unpack;
#if defined(__AVX2__)
    tile_fn tiles[MAX_TILE + 1];
#endif
} format_t;

static const format_t FORMATS[] = {
#if defined(__AVX2__)
    {sizeof(block_q4_1), q4_1_scalar, {0, q4_1_tile1, q4_1_tile2, q4_1_tile3, q4_1_tile4}},
    {sizeof(block_q4f), q4f_scalar, {0, q4f_tile1, q4f_tile2, q4f_tile3, q4f_tile4}},
    {sizeof(block_q8_0), q8_0_scalar, {0, q8_0_tile1, q8_0_tile2, q8_0_tile3, q8_0_tile4}},
    {sizeof(block_q8h), q8h_scalar, {0, q8h_tile1, q8h_tile2, q8h_tile3, q8h_tile4}},
#else
    {sizeof(block_q4_1), q4_1_scalar}, {sizeof(block_q4f), q4f_scalar},
    {sizeof(block_q8_0), q8_0_scalar}, {sizeof(block_q8h), q8h_scalar},
#endif
};

/* rows row0 and row1 (the same row where there is one) by activation rows m0 .. m0 + mc - 1 */
static inline void run_tile(const format_t* f, const void* row0, const void* row1, const act_t* a, int m0, int mc,
                            int K, float* out0, float* out1) {
#if defined(__AVX2__)
    f->tiles[mc](row0, row1, a, m0, K, out0, out1);
#else
    scalar_tile(f->unpack, f->block_bytes, row0, a, m0, mc, K, out0);
    if (row1 != row0) scalar_tile(f->unpack, f->block_bytes, row1, a, m0, mc, K, out1);
#endif
}

/* w: N rows of K/32 blocks of `format`; K a multiple of 32 */
void gguf_linear(const float* x, const void* w, int format, const float* bias, float* y, int M, int N, int K,
                 int threads) {
    const format_t* f = &FORMATS[format];
    int nb = K / QK, groups = (N + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP;
    size_t row_bytes = (size_t)nb * f->block_bytes;
    act_t a;
    a.q = malloc((size_t)M * K);
    a.d = malloc(sizeof(float) * (size_t)M * nb);
    a.s = malloc(sizeof(float) * (size_t)M * nb);
    quantize_rows(x, M, K, &a);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        int n0 = g * ROWS_PER_GROUP, n1 = n0 + ROWS_PER_GROUP < N ? n0 + ROWS_PER_GROUP : N;
        for (int m0 = 0; m0 < M; m0 += MAX_TILE) {
            int mc = M - m0 < MAX_TILE ? M - m0 : MAX_TILE;
            for (int n = n0; n < n1; n += 2) {
                float out[2][MAX_TILE];
                const char* row0 = (const char*)w + (size_t)n * row_bytes;
                int two = n + 1 < n1;
                run_tile(f, row0, two ? row0 + row_bytes : row0, &a, m0, mc, K, out[0], out[1]);
                for (int r = 0; r <= two; r++)
                    for (int c = 0; c < mc; c++) y[(size_t)(m0 + c) * N + n + r] = out[r][c] + (bias ? bias[n + r] : 0.f);
            }
        }
    }
    free(a.q);
    free(a.d);
    free(a.s);
}

/* rows `ids` of w dequantized into out [len(ids)][K] (embedding lookups, dense copies) */
void gguf_dequantize_rows(const void* w, int format, const int64_t* ids, int num_ids, int K, float* out,
                          int threads) {
    const format_t* f = &FORMATS[format];
    int nb = K / QK;
    #pragma omp parallel for schedule(static) num_threads(threads) if (num_ids >= 64)
    for (int i = 0; i < num_ids; i++) {
        int q[QK];
        const char* row = (const char*)w + (size_t)ids[i] * nb * f->block_bytes;
        for (int b = 0; b < nb; b++) {
            float lo, hi, m;
            f->unpack(row + b * f->block_bytes, q, &lo, &hi, &m);
            float* o = out + (size_t)i * K + b * QK;
            for (int j = 0; j < QK; j++) o[j] = (j < 16 ? lo : hi) * (float)q[j] + m;
        }
    }
}
