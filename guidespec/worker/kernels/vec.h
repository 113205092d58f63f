/* The kernels' vector type: the machine's own width (GCC vector extensions), 16 floats with
 * AVX-512, 8 with AVX, 4 otherwise. A vector wider than the machine's registers is lowered by
 * GCC through memory, element by element: a 16-wide packed_linear ran at 4 GFLOP/s on an AVX2
 * Zen 3, against ~135 at its own width. */
#ifndef GUIDESPEC_VEC_H
#define GUIDESPEC_VEC_H
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int vi __attribute__((vector_size(VW * 4)));
static inline vf ld(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, vf v) { memcpy(p, &v, sizeof v); }

#endif
