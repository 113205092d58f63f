/* 8-float vectors (GCC vector extensions: one AVX register, two SSE ones) and a vector exp,
 * shared by attention.c and layer_ops.c. */
#ifndef GUIDESPEC_VMATH_H
#define GUIDESPEC_VMATH_H
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8 splat(float x) { return (v8){0} + x; }
static inline v8 vsel(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }
static inline v8 load(const float* p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, v8 v) { memcpy(p, &v, sizeof v); }

/* exp on 8 lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]) */
static inline v8 vexp(v8 x) {
    x = vsel(x < splat(-87.3f), splat(-87.3f), x);
    x = vsel(x > splat(88.3f), splat(88.3f), x);
    v8 shifted = x * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) in the low mantissa */
    v8 n = shifted - 12582912.0f;
    v8i ni = (v8i)shifted - 0x4B400000;
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((ni + 127) << 23);
}

#endif
