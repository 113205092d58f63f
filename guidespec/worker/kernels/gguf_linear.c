/* Linear layers over GGUF's own quantized blocks: y[M, N] = x[M, K] @ w[N, K]^T + bias[N].
 *
 * Activations are quantized the way llama.cpp's Q8 dot products take them: per row and block
 * of 32 inputs, a scale d = max|x| / 127, int8 values q = round(x / d) and their sum times d.
 * A block's dot product is then integer (4-bit or 8-bit weights x int8) and scaled in fp32:
 *
 *   sum_i w_i x_i ~ dw * dx * sum_i qw_i qx_i + mw * (dx * sum_i qx_i)      (w_i = dw qw_i + mw)
 *
 * Why: decoding streams every weight once per token. Q4_1 blocks are 20 bytes per 32 weights
 * against 128 in fp32, so the step reads ~6x fewer bytes, and the integer products run 32 to an
 * instruction (AVX2 maddubs, or VNNI's dpbusd where the build has it).
 *
 * The weight's layout is the kernel's own (gguf_weights.py makes it once from the file's blocks):
 * each row's quants side by side, qs [N][nbw][16] (4-bit: input j < 16 in byte j's low nibble,
 * j + 16 in its high one, as ggml's Q4 blocks, whole groups interleaved as below) or
 * [N][nbw][32] (8-bit, signed), then the scales
 * apart, s0 [N][nbw] and s1 [N][nbw] (fp16 as the file stores them, or fp32 for the K-quants'
 * products): s0 the scale and s1 the offset of each block (Q8H: s0 the scale of inputs 0-15, s1
 * that of inputs 16-31). nbw is the row's blocks rounded up to even, the padding zero.
 *
 * The 5-bit formats (Q5_1 from Q5_0/Q5_1, Q5F from Q5_K) are a 4-bit format's row, nibbles as
 * above, followed by the blocks' fifth bits, 4 bytes a block, laid out for the products: a whole
 * group's 32 bytes hold in byte 4i + k, bit p, the fifth bit of block i's input 4p + k, and in
 * bit 4 + p that of input 16 + 4p + k, so a shift and a mask put each bit under the nibble it
 * completes (add_fifth_bits); a pair outside the whole groups has two 32-bit words, bit b of the
 * first the fifth bit of the pair's low-half byte b (the first block's inputs 0-15, then the
 * second's), of the second the same for the high halves (spread to bytes as llama.cpp does). The
 * quants reach 31: 8 of maddubs' int16 pair sums could reach 8 * 2 * 31 * 127 > 32767, so a
 * group's are widened four at a time (dpbusd's int32 sums are the same).
 *
 * Eight blocks make a group, one vector of 8 block sums, converted and scaled at once by 8 weight
 * scales times 8 activation scales, offsets added the same way: scales, offsets and conversions
 * cost a few instructions per 8 blocks, not per block. Two layouts get there:
 *
 * - interleaved (a 4-bit format's whole groups): 4-byte words of the 8 blocks side by side, so
 *   a product's lane i is block i's: the group's weight quants are 4 vectors, vector p's word i
 *   block i's bytes 4p..4p+3 (low nibbles inputs 4p.., high ones 16 + 4p..), and its activation
 *   is 8 vectors, vector r's word i block i's inputs 4r..4r+3. The 8 products (maddubs) add up
 *   as int16 without saturating (8 * 2 * 15 * 127 = 30480 < 32767) and widen once: no
 *   horizontal adds (one layer's linear layers at 176 rows: 1.3x faster than pairs on a Zen 3);
 *   with VNNI, 8 dpbusd in two chains give the same int32 sums without the adds (a layer's
 *   linear layers at 4 to 160 rows 5-13% faster on a Xeon with AVX-512 VNNI). Where the build
 *   has AVX-512 VNNI and a call 2 rows or more, the activation rows are laid out in pairs
 *   (act_t.paired: each 32-byte vector of row 2p, then row 2p + 1's), so one 512-bit dpbusd
 *   takes both rows against the weight's vector broadcast to both halves, and the scaling runs
 *   512-bit too (group8_pairs): lane for lane the same operations, so the same bits. A layer's
 *   linear layers on a Zen 5 EPYC, 1 thread: 4 rows 1.10x, 8 rows 1.49x, 16 to 160 rows
 *   1.16-1.21x (a 512-bit group8 as a drop-in, inserting two rows' vectors per product, was not
 *   faster on a Xeon);
 * - pairs (8-bit formats, and a row's last group where it is not whole): 4 pairs of blocks,
 *   each pair two 256-bit products (a pair's low halves, then its high halves, 32 bytes each:
 *   one load of 4-bit quants feeds both), whose lanes hold 4 partial sums of each block; two
 *   rounds of horizontal adds turn the 4 pairs into the 8 blocks' sums, in lane order 0 2 4 6
 *   1 3 5 7 (the activation's scales are written in that order by quantize_rows). A last group
 *   may hold 1 to 3 pairs (576 inputs, the default model's width, are 2 groups and a pair): it
 *   is compiled once per count, so the missing pairs cost no products.
 *
 * Each thread owns whole groups of 16 output rows; within a group each weight row is unpacked
 * once for up to 16 activation rows (tile_rows), so 1 to 8 rows (decode, verification) cost
 * about what one costs, and for prefill-sized M the group's weights stay in cache while the
 * activations stream. Every output is summed over the groups in order and its 8 lanes added in
 * one order (hsum, hsum8), the same way whatever M is: a row's result does not depend on the
 * other rows of the call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "pool.h"
#if defined(__AVX2__) && defined(__F16C__)
#define QUANT_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QUANT_ZMM 1  /* 4-bit groups of two activation rows at once (group8_pairs) */
#endif
#endif

enum { QK = 32, GROUP = 8, ROWS_PER_GROUP = 16 };
/* activation rows per unpacked weight row (tile_rows): 16 with AVX-512VL's 32 vector registers,
   where 16 accumulators and a group's 8 quant vectors stay in registers (one layer's linear
   layers at 256 rows: 7-11 ms against 13 with 8, on a Zen 4), and for AVX2's interleaved groups
   (176 rows: 13.0 ms against 13.7 with 8, on a Zen 3: the unpacking and the row's end are shared
   by more rows); AVX2's pairs keep 8, all their 16 registers hold */
enum { MAX_TILE = 16 };
enum { FMT_Q4_1 = 0, FMT_Q4F = 1, FMT_Q8_0 = 2, FMT_Q8H = 3, FMT_Q5_1 = 4, FMT_Q5F = 5 };

typedef struct {
    int qs_bytes;  /* per block: 16 (4-bit and 5-bit: the low 4 bits) or 32 (8-bit) */
    int f16;       /* scales in fp16 (else fp32) */
    int has_offset;
    int halves;    /* s1 is the scale of inputs 16-31 (Q8H) */
    int qh_bytes;  /* per block: 4 for the 5-bit formats' fifth bits (after the row's nibbles), else 0 */
} format_t;

static const format_t FORMATS[] = {
    {16, 1, 1, 0, 0},  /* Q4_1 (and Q4_0: offset -8 d) */
    {16, 0, 1, 0, 0},  /* Q4F: Q4_K per 32 inputs */
    {32, 1, 0, 0, 0},  /* Q8_0 */
    {32, 0, 0, 1, 0},  /* Q8H: Q6_K per 32 inputs, a scale per 16 */
    {16, 1, 1, 0, 4},  /* Q5_1 (and Q5_0: offset -16 d) */
    {16, 0, 1, 0, 4},  /* Q5F: Q5_K per 32 inputs */
};

static inline float fp16(uint16_t h) {
#if QUANT_AVX2
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

static inline float scale_at(const void* s, int f16, size_t i) {
    return f16 ? fp16(((const uint16_t*)s)[i]) : ((const float*)s)[i];
}

/* ---------------------------------------------------------------- activations */

typedef struct {
    int8_t* q;  /* [M][nbp * 32]: per group, interleaved (blocks below full) or in pairs */
    float* d;   /* [M][nbp]: the block's scale, in its lane */
    float* s;   /* [M][nbp]: d * the sum of the block's q, the same order */
    int nbp;
    int full;   /* blocks in interleaved groups: a 4-bit format's whole groups, else 0 */
    int paired; /* rows in pairs (M rounded up to even, the last padding zero): each 32-byte vector
                   of row 2p then the same of row 2p + 1, each 8 lanes of d and s likewise, so one
                   64-byte load holds both rows' (group8_pairs' 512-bit products) */
} act_t;

/* one activation row as the tiles read it: its vector k (32 bytes) at q + k * 32 (paired: k * 64),
   its lanes 8g..8g+7 of d and s at d + g * 8 and s + g * 8 (paired: g * 16) */
typedef struct {
    const int8_t* q;
    const float *d, *s;
} row_t;

/* where byte `at` of row r (as one row lays out alone) and lane `lane` of it sit */
static inline size_t q_at(const act_t* a, int r, size_t at) {
    if (!a->paired) return (size_t)r * a->nbp * QK + at;
    return (size_t)(r / 2) * a->nbp * QK * 2 + at / 32 * 64 + (size_t)(r & 1) * 32 + at % 32;
}
static inline size_t lane_in(const act_t* a, int r, size_t lane) {
    if (!a->paired) return (size_t)r * a->nbp + lane;
    return (size_t)(r / 2) * a->nbp * 2 + lane / 8 * 16 + (size_t)(r & 1) * 8 + lane % 8;
}

static inline row_t row_of(const act_t* a, int r) {
    row_t v = {a->q + q_at(a, r, 0), a->d + lane_in(a, r, 0), a->s + lane_in(a, r, 0)};
    return v;
}

/* where block i of a paired group sits in the group's lanes, and its halves in the group's bytes */
static inline int lane_of(int i) { return (i & 1) * 4 + i / 2; }
static inline int low_half_at(int i) { return (i / 2) * 64 + (i & 1) * 16; }

/* blocks in interleaved groups for a format and a row of nbw blocks */
static inline int interleaved_blocks(const format_t* f, int nbw) { return f->qs_bytes == 16 ? nbw / GROUP * GROUP : 0; }

/* byte k of block b in an interleaved group of blocks of `bytes` bytes: word k / 4 of each block
   in vector k / 4 (32 bytes), block b's at word b % GROUP */
static inline size_t interleaved_at(int b, int k, int bytes) {
    return (size_t)(b / GROUP) * GROUP * bytes + 32 * (k / 4) + 4 * (b % GROUP) + k % 4;
}

/* a row's activation: input j of block b, and the block's lane (scale and sum) */
static inline size_t act_at(int full, int b, int j) {
    if (b < full) return interleaved_at(b, j, QK);
    return (size_t)(b / GROUP) * GROUP * QK + low_half_at(b % GROUP) + (j < 16 ? j : 16 + j);
}
static inline int lane_at(int full, int b) { return b < full ? b : b / GROUP * GROUP + lane_of(b % GROUP); }

static void quantize_block(const float* xb, int8_t* lo, int8_t* hi, float* d_out, float* s_out) {
    float amax = 0.f;
#if QUANT_AVX2
    __m256 v[4], sign = _mm256_set1_ps(-0.f), m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256 scale = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));  /* nearest, ties even */
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* 32 int32 -> 32 int8 in order: packs interleave 128-bit lanes, the permute undoes it */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i*)lo, _mm256_castsi256_si128(p));
    _mm_storeu_si128((__m128i*)hi, _mm256_extracti128_si256(p, 1));
    *d_out = d;
    *s_out = d * (float)_mm_cvtsi128_si32(s4);
#else
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < QK; i++) {
        int q = (int)lrintf(xb[i] * id);
        (i < 16 ? lo : hi)[i % 16] = (int8_t)q;
        sum += q;
    }
    *d_out = d;
    *s_out = d * (float)sum;
#endif
}

typedef struct {
    const float* x;
    int K;
    act_t* a;
} quantize_args;

static void quantize_some(void* ctx, int begin, int end, int thread) {
    const quantize_args* args = ctx;
    act_t* a = args->a;
    int K = args->K, nb = K / QK;
    int8_t* q = a->q;
    float *d = a->d, *s = a->s;
    (void)thread;
    for (int r = begin; r < end; r++) {
        for (int b = 0; b < nb; b++) {
            int8_t tmp[QK];
            size_t at = act_at(a->full, b, 0), lane = lane_in(a, r, lane_at(a->full, b));
            quantize_block(args->x + (size_t)r * K + b * QK, tmp, tmp + 16, d + lane, s + lane);
            if (b < a->full) {  /* interleaved: the block's 8 words, a vector apart */
                for (int w = 0; w < 8; w++) memcpy(q + q_at(a, r, at + 32 * w), tmp + 4 * w, 4);
            } else {  /* a pair's low half, its high half 32 bytes on */
                memcpy(q + q_at(a, r, at), tmp, 16);
                memcpy(q + q_at(a, r, at + 32), tmp + 16, 16);
            }
        }
    }
}

static void quantize_rows(const float* x, int M, int K, act_t* a, int threads) {
    int nbp = a->nbp, rows = a->paired ? (M + 1) / 2 * 2 : M;
    /* the padding's quants, scales and sums zero (a zero weight block times NaN is NaN): the last
       group's blocks past the row's end, and a paired layout's padding row */
    memset(a->q, 0, (size_t)rows * nbp * QK);
    memset(a->d, 0, sizeof(float) * (size_t)rows * nbp);
    memset(a->s, 0, sizeof(float) * (size_t)rows * nbp);
    quantize_args args = {x, K, a};
    pool_for(M, PARALLEL_CHUNK(M, threads), threads, M >= 16, quantize_some, &args);
}

/* ---------------------------------------------------------------- the AVX2 tile */

#if QUANT_AVX2
/* lane i += the sum of products 4i..4i+3 of unsigned w and signed x */
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* lane i = the sum of products 4i..4i+3 of w1 by x1 and of w2 by x2 (unsigned w below 16: the
   int16 pair sums of both add without saturating, 2 * 2 * 15 * 127 < 32767, one widening madd) */
static inline __m256i dot2_u4s8(__m256i w1, __m256i x1, __m256i w2, __m256i x2) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w1, x1), w2, x2);
#else
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w1, x1), _mm256_maddubs_epi16(w2, x2));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

static inline __m256 load8(const void* s, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)) : _mm256_loadu_ps((const float*)s);
}

/* the sum of v's lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) */
static inline float hsum(__m256 v) {
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* hsum of v[0..8) at once, added in the same order (a row's sum is the same in any tile) */
static inline __m256 hsum8(const __m256* v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* the 4 pairs' products -> the 8 blocks' sums, lane order 0 2 4 6 1 3 5 7 */
static inline __m256 blocks_of(const __m256i t[4]) {
    return _mm256_cvtepi32_ps(_mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3])));
}

/* a whole group's fifth bits (32 bytes at wh, the layout above) put under the nibbles they
   complete: w[p] |= bit p of each byte, w[p + 4] |= bit 4 + p, as 16 (within a byte: the 16-bit
   shifts' bits from the next byte are masked off) */
static inline void add_fifth_bits(__m256i* w, const uint8_t* wh) {
    const __m256i bit = _mm256_set1_epi8(16);
    __m256i h = _mm256_loadu_si256((const __m256i*)wh);
    w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit));
    w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit));
    w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), bit));
    w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), bit));
    w[4] = _mm256_or_si256(w[4], _mm256_and_si256(h, bit));
    w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), bit));
    w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), bit));
    w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), bit));
}

/* 32 bits at x -> 32 bytes, byte b 0xff where bit b is set (llama.cpp's bytes_from_bits_32) */
static inline __m256i bytes_from_bits(const uint8_t* x) {
    uint32_t bits;
    memcpy(&bits, x, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* pairs (1 to 4) pairs of blocks of one weight row (quants wq, scales already in lane order)
   by mc activation rows, group g of each: acc[c] += the group's sums */
static inline __attribute__((always_inline)) void group(const format_t* f, const uint8_t* wq, const uint8_t* wh,
                                                        __m256 ws0, __m256 ws1, int pairs, const row_t* rows, int g,
                                                        int mc, int paired, __m256* acc) {
    const size_t vs = paired ? 64 : 32, ds = paired ? 16 : 8;  /* (a constant where it is inlined) */
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i lo[4], hi[4];  /* pair j's quants as unsigned bytes (8-bit: signed) */
    for (int j = 0; j < 4; j++) {
        if (j >= pairs) {
            lo[j] = hi[j] = _mm256_setzero_si256();
        } else if (f->qs_bytes == 16) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(wq + 32 * j));
            lo[j] = _mm256_and_si256(v, mask);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if (f->qh_bytes) {  /* the pair's two words of fifth bits (2 * 2 * 31 * 127 < 32767: dot2 holds) */
                const __m256i bit = _mm256_set1_epi8(16);
                lo[j] = _mm256_or_si256(lo[j], _mm256_and_si256(bytes_from_bits(wh + 8 * j), bit));
                hi[j] = _mm256_or_si256(hi[j], _mm256_and_si256(bytes_from_bits(wh + 8 * j + 4), bit));
            }
        } else {
            const uint8_t* p = wq + 64 * j;
            lo[j] = _mm256_loadu2_m128i((const __m128i*)(p + 32), (const __m128i*)p);
            hi[j] = _mm256_loadu2_m128i((const __m128i*)(p + 48), (const __m128i*)(p + 16));
        }
    }
    for (int c = 0; c < mc; c++) {
        const row_t* x = rows + c;
        const int8_t* xq = x->q + (size_t)g * GROUP * vs;
        __m256 dx = _mm256_loadu_ps(x->d + (size_t)g * ds);
        __m256i t[4], u[4];
        for (int j = 0; j < 4; j++) {
            if (j >= pairs) {  /* a row's last group: pairs is a constant there (tile's switch) */
                t[j] = u[j] = _mm256_setzero_si256();
                continue;
            }
            __m256i xl = _mm256_loadu_si256((const __m256i*)(xq + (size_t)(2 * j) * vs));
            __m256i xh = _mm256_loadu_si256((const __m256i*)(xq + (size_t)(2 * j + 1) * vs));
            if (f->qs_bytes == 16) {
                t[j] = dot2_u4s8(lo[j], xl, hi[j], xh);
            } else {  /* signed weights: |w| times x with w's sign */
                __m256i l = _mm256_sign_epi8(xl, lo[j]), h = _mm256_sign_epi8(xh, hi[j]);
                __m256i la = _mm256_sign_epi8(lo[j], lo[j]), ha = _mm256_sign_epi8(hi[j], hi[j]);
                if (f->halves) {
                    t[j] = dot_u8s8(_mm256_setzero_si256(), la, l);
                    u[j] = dot_u8s8(_mm256_setzero_si256(), ha, h);
                } else {
                    t[j] = dot_u8s8(dot_u8s8(_mm256_setzero_si256(), la, l), ha, h);
                }
            }
        }
        acc[c] = _mm256_fmadd_ps(blocks_of(t), _mm256_mul_ps(ws0, dx), acc[c]);
        if (f->halves) acc[c] = _mm256_fmadd_ps(blocks_of(u), _mm256_mul_ps(ws1, dx), acc[c]);
        if (f->has_offset) acc[c] = _mm256_fmadd_ps(ws1, _mm256_loadu_ps(x->s + (size_t)g * ds), acc[c]);
    }
}

/* an interleaved group (4-bit quants wq, scales in block order; 5-bit: `five` and the group's
   fifth bits wh) of one weight row by mc activation rows, group g of each: acc[c] += the group's
   sums */
static inline __attribute__((always_inline)) void group8(const uint8_t* wq, const uint8_t* wh, int five, __m256 ws0,
                                                         __m256 ws1, const row_t* rows, int g, int mc, __m256* acc) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i w[8];  /* w[r] pairs with the activation's vector r */
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(wq + 32 * p));
        w[p] = _mm256_and_si256(v, mask);
        w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
    if (five) add_fifth_bits(w, wh);
    for (int c = 0; c < mc; c++) {
        const __m256i* x = (const __m256i*)(rows[c].q + (size_t)g * GROUP * 32);  /* (unpaired) */
#define X(r) _mm256_loadu_si256(x + (r))
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        /* dpbusd: the same int32 sums as the maddubs tree below, without its adds (two chains) */
        __m256i e = _mm256_setzero_si256(), o = _mm256_setzero_si256();
        for (int r = 0; r < 8; r += 2) {
            e = _mm256_dpbusd_epi32(e, w[r], X(r));
            o = _mm256_dpbusd_epi32(o, w[r + 1], X(r + 1));
        }
        __m256 sums = _mm256_cvtepi32_ps(_mm256_add_epi32(e, o));
#else
        __m256i p[8];
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < 8; r++) p[r] = _mm256_maddubs_epi16(w[r], X(r));
        __m256i sum_a = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        __m256i sum_b = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
        __m256i sum32 = five ? _mm256_add_epi32(_mm256_madd_epi16(sum_a, ones), _mm256_madd_epi16(sum_b, ones))
                             : _mm256_madd_epi16(_mm256_add_epi16(sum_a, sum_b), ones);  /* (5-bit: 4 * 7874 fit) */
        __m256 sums = _mm256_cvtepi32_ps(sum32);
#endif
#undef X
        acc[c] = _mm256_fmadd_ps(sums, _mm256_mul_ps(ws0, _mm256_loadu_ps(rows[c].d + (size_t)g * 8)), acc[c]);
        acc[c] = _mm256_fmadd_ps(ws1, _mm256_loadu_ps(rows[c].s + (size_t)g * 8), acc[c]);
    }
}

#if QUANT_ZMM
/* group8 for row pairs (the paired layout): each 512-bit product holds both rows' 8 lanes, the
   weight's vectors broadcast to both halves; the same int32 sums and float operations, lane by
   lane, as group8's dpbusd: accp[p] (row 2p low, 2p + 1 high) += the group's sums */
static inline __attribute__((always_inline)) void group8_pairs(const uint8_t* wq, const uint8_t* wh, int five,
                                                               __m256 ws0, __m256 ws1, const row_t* rows, int g,
                                                               int pairs, __m512* accp) {
    const __m512 w0 = _mm512_broadcast_f32x8(ws0), w1 = _mm512_broadcast_f32x8(ws1);
    __m512i w[8];
    if (five) {  /* group8's 256-bit vectors, fifth bits added, each broadcast to both halves */
        const __m256i mask = _mm256_set1_epi8(15);
        __m256i half[8];
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(wq + 32 * p));
            half[p] = _mm256_and_si256(v, mask);
            half[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        add_fifth_bits(half, wh);
        for (int r = 0; r < 8; r++) w[r] = _mm512_broadcast_i64x4(half[r]);
    } else {
        const __m512i mask = _mm512_set1_epi8(15);
        for (int p = 0; p < 4; p++) {
            __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(wq + 32 * p)));
            w[p] = _mm512_and_si512(v, mask);
            w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
    }
    for (int p = 0; p < pairs; p++) {
        const row_t* x = rows + 2 * p;  /* its vectors 64 bytes apart, the odd row's 32 bytes on */
        const int8_t* xq = x->q + (size_t)g * GROUP * 64;
        __m512i e = _mm512_setzero_si512(), o = _mm512_setzero_si512();
        for (int r = 0; r < 8; r += 2) {
            e = _mm512_dpbusd_epi32(e, w[r], _mm512_loadu_si512(xq + 64 * r));
            o = _mm512_dpbusd_epi32(o, w[r + 1], _mm512_loadu_si512(xq + 64 * (r + 1)));
        }
        __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(e, o));
        accp[p] = _mm512_fmadd_ps(sums, _mm512_mul_ps(w0, _mm512_loadu_ps(x->d + (size_t)g * 16)), accp[p]);
        accp[p] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x->s + (size_t)g * 16), accp[p]);
    }
}
#endif

/* one weight row of nbw blocks (its qs, s0, s1 at the row's start) by mc activation rows (their
   views, row_of); with `paired` (the activation paired, the first row even, mc even), the whole
   groups two rows at a time */
static inline __attribute__((always_inline)) void tile(const format_t* f, const uint8_t* qs, const void* s0,
                                                       const void* s1, int nbw, const act_t* a, const row_t* rows,
                                                       int mc, int paired, float* out) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const int ss = f->f16 ? 2 : 4, two = f->has_offset || f->halves, five = f->qh_bytes != 0;
    const uint8_t* qh = qs + (size_t)nbw * f->qs_bytes;  /* (5-bit: the fifth bits, 4 bytes a block) */
    __m256 acc[MAX_TILE];
    for (int c = 0; c < mc; c++) acc[c] = _mm256_setzero_ps();
    int g = 0;
#if QUANT_ZMM
    if (paired) {  /* the whole groups' sums in pairs of rows, then each row's own accumulator */
        __m512 accp[MAX_TILE / 2];
        for (int p = 0; p < mc / 2; p++) accp[p] = _mm512_setzero_ps();
        for (; g < a->full / GROUP; g++)
            group8_pairs(qs + (size_t)g * GROUP * 16, qh + (size_t)g * GROUP * 4, five,
                         load8((const char*)s0 + (size_t)g * GROUP * ss, f->f16),
                         load8((const char*)s1 + (size_t)g * GROUP * ss, f->f16), rows, g, mc / 2, accp);
        for (int p = 0; p < mc / 2; p++) {
            acc[2 * p] = _mm512_castps512_ps256(accp[p]);
            acc[2 * p + 1] = _mm512_extractf32x8_ps(accp[p], 1);
        }
    } else
#endif
    {
        for (; g < a->full / GROUP; g++)  /* 4/5-bit formats' whole groups: their scales in block order */
            group8(qs + (size_t)g * GROUP * 16, qh + (size_t)g * GROUP * 4, five,
                   load8((const char*)s0 + (size_t)g * GROUP * ss, f->f16),
                   load8((const char*)s1 + (size_t)g * GROUP * ss, f->f16), rows, g, mc, acc);
    }
    for (; g < nbw / GROUP; g++) {
        __m256 ws0 = _mm256_permutevar8x32_ps(load8((const char*)s0 + (size_t)g * GROUP * ss, f->f16), perm);
        __m256 ws1 = two ? _mm256_permutevar8x32_ps(load8((const char*)s1 + (size_t)g * GROUP * ss, f->f16), perm)
                         : _mm256_setzero_ps();
        group(f, qs + (size_t)g * GROUP * f->qs_bytes, 0, ws0, ws1, 4, rows, g, mc, paired, acc);  /* (8-bit) */
    }
    int rest = nbw - g * GROUP;  /* an even number of blocks: the row's last pairs */
    if (rest) {
        float w0[GROUP] = {0}, w1[GROUP] = {0};
        for (int i = 0; i < rest; i++) {
            w0[lane_of(i)] = scale_at(s0, f->f16, (size_t)g * GROUP + i);
            if (two) w1[lane_of(i)] = scale_at(s1, f->f16, (size_t)g * GROUP + i);
        }
        const uint8_t *wq = qs + (size_t)g * GROUP * f->qs_bytes, *wh = qh + (size_t)g * GROUP * 4;
        __m256 ws0 = _mm256_loadu_ps(w0), ws1 = _mm256_loadu_ps(w1);
        switch (rest / 2) {  /* each count its own code: the missing pairs cost nothing */
            case 1: group(f, wq, wh, ws0, ws1, 1, rows, g, mc, paired, acc); break;
            case 2: group(f, wq, wh, ws0, ws1, 2, rows, g, mc, paired, acc); break;
            default: group(f, wq, wh, ws0, ws1, 3, rows, g, mc, paired, acc); break;
        }
    }
    int c = 0;
    for (; c + 8 <= mc; c += 8) _mm256_storeu_ps(out + c, hsum8(acc + c));
    for (; c < mc; c++) out[c] = hsum(acc[c]);
}

/* the compiler specializes each format, row count and layout (the format's branches fold away;
   a paired call's counts are even) */
#define TILE_CASE(N)                                                                                      \
    case N:                                                                                               \
        if (a->paired)                                                                                    \
            tile(f, qs, s0, s1, nbw, a, rows, N, 1, out);                                                 \
        else                                                                                              \
            tile(f, qs, s0, s1, nbw, a, rows, N, 0, out);                                                 \
        break;
#define TILE_FOR(FMT)                                                                                     \
    static void tile_##FMT(const uint8_t* qs, const void* s0, const void* s1, int nbw, const act_t* a,         \
                           const row_t* rows, int mc, float* out) {                                       \
        const format_t* f = &FORMATS[FMT];                                                                \
        switch (mc) {                                                                                     \
            TILE_CASE(1)                                                                                  \
            TILE_CASE(2)                                                                                  \
            TILE_CASE(3)                                                                                  \
            TILE_CASE(4)                                                                                  \
            TILE_CASE(8)                                                                                  \
            TILE_CASE(16)                                                                                 \
            default: tile(f, qs, s0, s1, nbw, a, rows, mc, a->paired, out); break;                       \
        }                                                                                                 \
    }
TILE_FOR(FMT_Q4_1)
TILE_FOR(FMT_Q4F)
TILE_FOR(FMT_Q8_0)
TILE_FOR(FMT_Q8H)
TILE_FOR(FMT_Q5_1)
TILE_FOR(FMT_Q5F)
typedef void (*tile_fn)(const uint8_t*, const void*, const void*, int, const act_t*, const row_t*, int, float*);
static const tile_fn TILES[] = {tile_FMT_Q4_1, tile_FMT_Q4F, tile_FMT_Q8_0, tile_FMT_Q8H, tile_FMT_Q5_1, tile_FMT_Q5F};
#endif

/* ---------------------------------------------------------------- the portable tile */

/* the fifth bit of block b's input j in a row's fifth bits qh (the layout at the top) */
static inline int fifth_bit(const uint8_t* qh, int full, int b, int j) {
    if (b < full) return (qh[(size_t)b / GROUP * 32 + 4 * (b % GROUP) + j % 4] >> ((j % 16) / 4 + 4 * (j / 16))) & 1;
    int bit = (b - full) % 2 * 16 + j % 16;  /* in the pair's word for low (j < 16) or high halves */
    return (qh[(size_t)full * 4 + (b - full) / 2 * 8 + (j / 16) * 4 + bit / 8] >> (bit % 8)) & 1;
}

/* block b's quant j of a row of nbw blocks whose first `full` are interleaved (4-bit: unsigned
   0..15; 5-bit: 0..31; 8-bit: signed) */
static inline int quant(const format_t* f, const uint8_t* qs, int nbw, int full, int b, int j) {
    if (f->qs_bytes == 16) {
        int k = j % 16;
        size_t at = b < full ? interleaved_at(b, k, 16) : (size_t)b * 16 + k;
        int q = j < 16 ? qs[at] & 15 : qs[at] >> 4;
        return f->qh_bytes ? q | (fifth_bit(qs + (size_t)nbw * 16, full, b, j) << 4) : q;
    }
    return ((const int8_t*)qs)[(size_t)b * 32 + j];
}

__attribute__((unused)) static void scalar_tile(const format_t* f, const uint8_t* qs, const void* s0, const void* s1,
                                                int nbw, const act_t* a, int m0, int mc, float* out) {
    for (int c = 0; c < mc; c++) {
        float sum = 0.f;
        int r = m0 + c;
        for (int b = 0; b < nbw; b++) {
            size_t lane = lane_in(a, r, lane_at(a->full, b));
            int d0 = 0, d1 = 0;
            for (int j = 0; j < 16; j++) {
                d0 += quant(f, qs, nbw, a->full, b, j) * a->q[q_at(a, r, act_at(a->full, b, j))];
                d1 += quant(f, qs, nbw, a->full, b, j + 16) * a->q[q_at(a, r, act_at(a->full, b, j + 16))];
            }
            float w0 = scale_at(s0, f->f16, b), dx = a->d[lane];
            if (f->halves) {
                sum += w0 * dx * (float)d0 + scale_at(s1, f->f16, b) * dx * (float)d1;
            } else {
                sum += w0 * dx * (float)(d0 + d1);
                if (f->has_offset) sum += scale_at(s1, f->f16, b) * a->s[lane];
            }
        }
        out[c] = sum;
    }
}

/* ---------------------------------------------------------------- entry points */

static int tile_rows(const format_t* f) {
#if defined(__AVX512VL__)
    return 16;
#else
    return f->qs_bytes == 16 ? 16 : 8;
#endif
}

typedef struct {
    const format_t* f;
    const uint8_t* qs;
    const void *s0, *s1;
    int format;
    const float* bias;
    const int32_t* ids;
    float* y;
    int M, N, nbw, rows, m_rows;
    size_t qs_row, s_row;
    act_t* a;
    const row_t* views;
} rows_args;

static void linear_groups(void* ctx, int begin, int end, int thread) {
    const rows_args* c = ctx;
    int M = c->M, N = c->N, rows = c->rows, m_rows = c->m_rows, nbw = c->nbw;
    (void)thread;
    for (int g = begin; g < end; g++) {
        int n0 = g * ROWS_PER_GROUP, n1 = n0 + ROWS_PER_GROUP < N ? n0 + ROWS_PER_GROUP : N;
        for (int m0 = 0; m0 < M; m0 += rows) {
            int mc = m_rows - m0 < rows ? m_rows - m0 : rows;
            for (int n = n0; n < n1; n++) {
                float out[MAX_TILE];
                size_t w = c->ids ? (size_t)c->ids[n] : (size_t)n;
                const uint8_t* row_qs = c->qs + w * c->qs_row;
                const char* row_s0 = (const char*)c->s0 + w * c->s_row;
                const char* row_s1 = c->s1 ? (const char*)c->s1 + w * c->s_row : 0;
#if QUANT_AVX2
                TILES[c->format](row_qs, row_s0, row_s1, nbw, c->a, c->views + m0, mc, out);
#else
                scalar_tile(c->f, row_qs, row_s0, row_s1, nbw, c->a, m0, mc, out);
#endif
                for (int k = 0; k < mc && m0 + k < M; k++)
                    c->y[(size_t)(m0 + k) * N + n] = out[k] + (c->bias ? c->bias[w] : 0.f);
            }
        }
    }
}

/* y [M][N]: output n is weight row ids[n] (ids NULL: row n) */
static void linear_rows(const float* x, const uint8_t* qs, const void* s0, const void* s1, int format,
                        const float* bias, const int32_t* ids, float* y, int M, int N, int K, int threads) {
    const format_t* f = &FORMATS[format];
    int nbw = (K / QK + 1) / 2 * 2, nbp = (K / QK + GROUP - 1) / GROUP * GROUP;
    int groups = (N + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP, rows = tile_rows(f);
    size_t qs_row = (size_t)nbw * (f->qs_bytes + f->qh_bytes), s_row = (size_t)nbw * (f->f16 ? 2 : 4);
    act_t a;
    a.nbp = nbp;
    a.full = interleaved_blocks(f, nbw);
#if QUANT_ZMM
    a.paired = a.full > 0 && M >= 2;  /* 4-bit groups: two rows a product */
#else
    a.paired = 0;
#endif
    int m_rows = a.paired ? (M + 1) / 2 * 2 : M;  /* (paired: a zero row pads an odd M) */
    a.q = malloc((size_t)m_rows * nbp * QK);
    a.d = malloc(sizeof(float) * (size_t)m_rows * nbp);
    a.s = malloc(sizeof(float) * (size_t)m_rows * nbp);
    quantize_rows(x, M, K, &a, threads);
    row_t* views = malloc(sizeof(row_t) * (size_t)m_rows);  /* each row's, once */
    for (int r = 0; r < m_rows; r++) views[r] = row_of(&a, r);
    rows_args c = {f, qs, s0, s1, format, bias, ids, y, M, N, nbw, rows, m_rows, qs_row, s_row, &a, views};
    pool_for(groups, PARALLEL_CHUNK(groups, threads), threads, (size_t)M * N * K >= PARALLEL_MIN_WORK, linear_groups, &c);
    free(views);
    free(a.q);
    free(a.d);
    free(a.s);
}

/* w: N rows of nbw = K/32 rounded up to even blocks in the kernel's layout (above); K a multiple of 32 */
void gguf_linear(const float* x, const uint8_t* qs, const void* s0, const void* s1, int format, const float* bias,
                 float* y, int M, int N, int K, int threads) {
    linear_rows(x, qs, s0, s1, format, bias, 0, y, M, N, K, threads);
}

/* only the outputs of weight rows ids[0..num_ids): y [M][num_ids], each value what gguf_linear
   gives for it (an LM head over the tokens a grammar allows) */
void gguf_linear_rows(const float* x, const uint8_t* qs, const void* s0, const void* s1, int format,
                      const int32_t* ids, int num_ids, float* y, int M, int K, int threads) {
    linear_rows(x, qs, s0, s1, format, 0, ids, y, M, num_ids, K, threads);
}

typedef struct {
    const format_t* f;
    const uint8_t* qs;
    const void *s0, *s1;
    const int64_t* ids;
    int K, nb, nbw, full;
    float* out;
} dequantize_args;

static void dequantize_some(void* ctx, int begin, int end, int thread) {
    const dequantize_args* a = ctx;
    const format_t* f = a->f;
    int nb = a->nb, nbw = a->nbw, full = a->full, K = a->K;
    (void)thread;
    for (int i = begin; i < end; i++) {
        size_t n = (size_t)a->ids[i];
        const uint8_t* row = a->qs + n * nbw * (f->qs_bytes + f->qh_bytes);
        for (int b = 0; b < nb; b++) {
            float w0 = scale_at(a->s0, f->f16, n * nbw + b);
            float w1 = f->has_offset || f->halves ? scale_at(a->s1, f->f16, n * nbw + b) : 0.f;
            float* o = a->out + (size_t)i * K + b * QK;
            for (int j = 0; j < QK; j++) {
                float q = (float)quant(f, row, nbw, full, b, j);
                o[j] = f->halves ? (j < 16 ? w0 : w1) * q : w0 * q + w1;
            }
        }
    }
}

/* rows `ids` of w (the kernel's layout) dequantized into out [len(ids)][K] (embedding lookups) */
void gguf_dequantize_rows(const uint8_t* qs, const void* s0, const void* s1, int format, const int64_t* ids,
                          int num_ids, int K, float* out, int threads) {
    const format_t* f = &FORMATS[format];
    int nb = K / QK, nbw = (nb + 1) / 2 * 2, full = interleaved_blocks(f, nbw);
    dequantize_args a = {f, qs, s0, s1, ids, K, nb, nbw, full, out};
    pool_for(num_ids, PARALLEL_CHUNK(num_ids, threads), threads, num_ids >= 64, dequantize_some, &a);
}
