/* Products of fp32 activations with int8 and int4 weights, and their dequantization: the CPU
 * kernels of the quantized products (formats in compiled_engine/linear/quantized_weight.py).
 *
 *   y[r, o] = sum_i x[r, i] * w[o, i] + bias[o]       x [rows, in], w [out, in], y [rows, out]
 *
 * int8:  w[o, i] = scale[o, g] * q[o, i] (+ offset[o, g]) q int8 [out, in]; offsets optional
 * int4:  w[o, i] = scale[o, g] * q[o, i] + offset[o, g] q 0..15, two to a byte, blocks of 32:
 *        byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble)
 * with g = i / group. Scales and offsets are fp32 [out, in / group].
 *
 * Each weight is read once, whatever the number of rows: a group's dot products with the
 * integer weights are summed in fp32 and scaled once, sum_g scale_g (x_g . q_g), and the
 * offsets (int4's, and int8's when it has them) add offset_g * sum(x_g) from sums of x taken once
 * per call. Accumulation is fp32
 * throughout. Output rows are split across threads (OpenMP); rows of x are taken four at a time
 * so that a block of weights, converted to floats once, serves four rows.
 *
 * Vectors are GCC/Clang vector extensions of 8 floats, as in the attention kernel. The products'
 * inner loops run on `wvec`, the widest vector the CPU converts integers into: 16 floats where the
 * build has AVX-512 (one conversion and one multiply-add per 16 weights), else the 8 of `vec`.
 * Every function returns 0, or a nonzero status for shapes it does not take.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define TILE 4    /* rows of x per pass over a weight row */
#define STRIP 16  /* output rows per unit of work */

typedef float vec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4)));

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline void store(float *p, vec x) { *(vec_u *)p = x; }
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
static inline float hsum(vec x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
/* A block of 32 int4 weights (16 bytes) as four vectors of floats: weights 0-7, 8-15, 16-23, 24-31. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline void nibbles32(const uint8_t *block, vec w[4]) {
    /* Widen 8 bytes to 32-bit lanes straight from memory, then split each lane's two nibbles. */
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)block));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8)));
    __m256i mask = _mm256_set1_epi32(15);
    w[0] = (vec)_mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    w[1] = (vec)_mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    w[2] = (vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    w[3] = (vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
static inline vec int8s(const int8_t *p) {
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif
#if defined(__AVX512F__)
/* The products' vectors: 16 floats. */
#define WL 16
typedef float wvec __attribute__((vector_size(64)));
typedef float wvec_u __attribute__((vector_size(64), aligned(4)));
static inline wvec wload(const float *p) { return *(const wvec_u *)p; }
static inline wvec wsplat(float x) { return (wvec)_mm512_set1_ps(x); }
static inline float whsum(wvec x) { return _mm512_reduce_add_ps((__m512)x); }
/* A block of 32 int4 weights as two vectors: weights 0-15 (low nibbles), 16-31 (high). */
static inline void wnibbles32(const uint8_t *block, wvec w[2]) {
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block));
    w[0] = (wvec)_mm512_cvtepi32_ps(_mm512_and_si512(a, _mm512_set1_epi32(15)));
    w[1] = (wvec)_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
}
static inline wvec wint8s(const int8_t *p) {
    return (wvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 8 int8 weights and 8 floats of x in the low half of a vector, zeros above (a group's tail). */
static inline wvec wint8s_low(const int8_t *p) {
    return (wvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline wvec wload_low(const float *p) { return (wvec)_mm512_maskz_loadu_ps(0x00FF, p); }
#endif
#if !defined(__AVX2__) /* portable, and slower: compilers convert vectors of bytes to floats one byte at a time */
static inline void nibbles32(const uint8_t *block, vec w[4]) {
    for (int j = 0; j < 8; j++) {
        w[0][j] = block[j] & 15;
        w[1][j] = block[j + 8] & 15;
        w[2][j] = block[j] >> 4;
        w[3][j] = block[j + 8] >> 4;
    }
}
static inline vec int8s(const int8_t *p) {
    vec w;
    for (int j = 0; j < 8; j++) w[j] = p[j];
    return w;
}
#endif
#if !defined(__AVX512F__)
#define WL 8
typedef vec wvec;
typedef vec_u wvec_u;
static inline wvec wload(const float *p) { return load(p); }
static inline wvec wsplat(float x) { return splat(x); }
static inline float whsum(wvec x) { return hsum(x); }
static inline void wnibbles32(const uint8_t *block, wvec w[4]) { nibbles32(block, w); }
static inline wvec wint8s(const int8_t *p) { return int8s(p); }
static inline wvec wint8s_low(const int8_t *p) { return int8s(p); }
static inline wvec wload_low(const float *p) { return load(p); }
#endif

/* sums[r, g] = sum of x[r] over group g. */
static void group_sums(const float *x, int64_t rows, int64_t in, int64_t group, float *sums) {
    int64_t groups = in / group;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *p = x + r * in + g * group;
            vec acc = splat(0.0f);
            for (int64_t i = 0; i < group; i += LANES) acc += load(p + i);
            sums[r * groups + g] = hsum(acc);
        }
}

/* One weight row against `n` (1..TILE) rows of x starting at xs. Always inlined with a constant
 * n (see the switches below), so that the accumulators live in registers. */
#define INLINE static inline __attribute__((always_inline))

/* sum_g a[g] * b[g] */
static inline float dot(const float *a, const float *b, int64_t n) {
    vec acc = splat(0.0f);
    int64_t g = 0;
    for (; g + LANES <= n; g += LANES) acc += load(a + g) * load(b + g);
    float rest = 0.0f;
    for (; g < n; g++) rest += a[g] * b[g];
    return hsum(acc) + rest;
}

/* One group of int4 weights against n rows: acc[r] += scale * (x_g . q_g). */
INLINE void int4_group(const float *xs, int64_t n, int64_t in, const uint8_t *q, float scale, int64_t first,
                       int64_t group, wvec *total) {
    wvec acc[TILE];
    for (int64_t r = 0; r < n; r++) acc[r] = wsplat(0.0f);
    for (int64_t i = first; i < first + group; i += 32) {
        wvec w[32 / WL];
        wnibbles32(q + i / 2, w);
        for (int64_t r = 0; r < n; r++) {
            const float *x = xs + r * in + i;
            wvec sum = w[0] * wload(x);
            for (int k = 1; k < 32 / WL; k++) sum += w[k] * wload(x + k * WL);
            acc[r] += sum;
        }
    }
    wvec s = wsplat(scale);
    for (int64_t r = 0; r < n; r++) total[r] += s * acc[r];
}

/* One group of int8 weights against n rows: total[r] += scale * (x_g . q_g). */
INLINE void int8_group(const float *xs, int64_t n, int64_t in, const int8_t *q, float scale, int64_t first,
                       int64_t group, wvec *total) {
    wvec acc[TILE];
    for (int64_t r = 0; r < n; r++) acc[r] = wsplat(0.0f);
    int64_t i = first, end = first + group;
    for (; i + 32 <= end; i += 32) {
        wvec w[32 / WL];
        for (int k = 0; k < 32 / WL; k++) w[k] = wint8s(q + i + k * WL);
        for (int64_t r = 0; r < n; r++) {
            const float *x = xs + r * in + i;
            wvec sum = w[0] * wload(x);
            for (int k = 1; k < 32 / WL; k++) sum += w[k] * wload(x + k * WL);
            acc[r] += sum;
        }
    }
    for (; i + 16 <= end; i += 16) {
        wvec w[16 / WL];
        for (int k = 0; k < 16 / WL; k++) w[k] = wint8s(q + i + k * WL);
        for (int64_t r = 0; r < n; r++) {
            const float *x = xs + r * in + i;
            wvec sum = w[0] * wload(x);
            for (int k = 1; k < 16 / WL; k++) sum += w[k] * wload(x + k * WL);
            acc[r] += sum;
        }
    }
    for (; i < end; i += LANES) { /* a tail of 8 (the low half of a wide vector) */
        wvec w = wint8s_low(q + i);
        for (int64_t r = 0; r < n; r++) acc[r] += w * wload_low(xs + r * in + i);
    }
    wvec s = wsplat(scale);
    for (int64_t r = 0; r < n; r++) total[r] += s * acc[r];
}

/* One weight row (int4 when `int4`, a constant once inlined; else int8) against n rows of x:
 * out[r] = sum_g scale_g (x_g . q_g) + sum_g offset_g * sum(x_g) (offsets may be NULL for int8).
 * Even and odd groups add into separate totals, so that consecutive groups (the k-quants' groups
 * of 16 above all) do not wait on each other's multiply-add. */
INLINE void quant_row(const float *xs, int64_t n, int64_t in, const void *q, int int4, const float *scale,
                      const float *offset, int64_t group, const float *sums, int64_t groups, float *out) {
    wvec even[TILE], odd[TILE];
    for (int64_t r = 0; r < n; r++) even[r] = odd[r] = wsplat(0.0f);
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        for (int64_t h = 0; h < 2; h++) {
            if (int4) int4_group(xs, n, in, q, scale[g + h], (g + h) * group, group, h ? odd : even);
            else int8_group(xs, n, in, q, scale[g + h], (g + h) * group, group, h ? odd : even);
        }
    }
    if (g < groups) {
        if (int4) int4_group(xs, n, in, q, scale[g], g * group, group, even);
        else int8_group(xs, n, in, q, scale[g], g * group, group, even);
    }
    for (int64_t r = 0; r < n; r++)
        out[r] = whsum(even[r] + odd[r]) + (offset ? dot(offset, sums + r * groups, groups) : 0.0f);
}
INLINE void int4_row(const float *xs, int64_t n, int64_t in, const uint8_t *q, const float *scale,
                     const float *offset, int64_t group, const float *sums, int64_t groups, float *out) {
    quant_row(xs, n, in, q, 1, scale, offset, group, sums, groups, out);
}
INLINE void int8_row(const float *xs, int64_t n, int64_t in, const int8_t *q, const float *scale,
                     const float *offset, int64_t group, const float *sums, int64_t groups, float *out) {
    quant_row(xs, n, in, q, 0, scale, offset, group, sums, groups, out);
}

/* Output rows [first * STRIP, last * STRIP) of the int4 product (whole strips; the last may be
 * short), on the calling thread: the unit of work of int4_matmul_f32, exposed so that a caller
 * running its own parallel region (the LoRA operator) can take its share. `sums` as group_sums
 * gives them. Shapes are the caller's to check (int4_matmul_f32 does). */
void int4_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const uint8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last) {
    int64_t groups = in / group;
    for (int64_t s = first; s < last; s++) {
        float part[TILE];
        int64_t end = s * STRIP + STRIP < out ? s * STRIP + STRIP : out;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int64_t n = rows - r0 < TILE ? rows - r0 : TILE;
            for (int64_t o = s * STRIP; o < end; o++) {
                const float *xs = x + r0 * in, *sc = scales + o * groups, *of = offsets + o * groups,
                            *su = sums + r0 * groups;
                const uint8_t *q = data + o * (in / 2);
                /* GGUF's groups of 32 get code of their own, with the block loop unrolled away. */
                if (group == 32) {
                    switch (n) {
                    case 1: int4_row(xs, 1, in, q, sc, of, 32, su, groups, part); break;
                    case 2: int4_row(xs, 2, in, q, sc, of, 32, su, groups, part); break;
                    case 3: int4_row(xs, 3, in, q, sc, of, 32, su, groups, part); break;
                    default: int4_row(xs, 4, in, q, sc, of, 32, su, groups, part); break;
                    }
                } else {
                    switch (n) {
                    case 1: int4_row(xs, 1, in, q, sc, of, group, su, groups, part); break;
                    case 2: int4_row(xs, 2, in, q, sc, of, group, su, groups, part); break;
                    case 3: int4_row(xs, 3, in, q, sc, of, group, su, groups, part); break;
                    default: int4_row(xs, 4, in, q, sc, of, group, su, groups, part); break;
                    }
                }
                for (int64_t r = 0; r < n; r++) y[(r0 + r) * out + o] = part[r] + (bias ? bias[o] : 0.0f);
            }
        }
    }
}

/* The int8 product's strips [first, last), as int4_matmul_strips_f32; `offsets` (and then
 * `sums`) may be NULL. */
void int8_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const int8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last) {
    int64_t groups = in / group;
    for (int64_t s = first; s < last; s++) {
        float part[TILE];
        int64_t end = s * STRIP + STRIP < out ? s * STRIP + STRIP : out;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int64_t n = rows - r0 < TILE ? rows - r0 : TILE;
            for (int64_t o = s * STRIP; o < end; o++) {
                const float *xs = x + r0 * in, *sc = scales + o * groups,
                            *of = offsets ? offsets + o * groups : NULL, *su = sums ? sums + r0 * groups : NULL;
                const int8_t *q = data + o * in;
                if (group == 32) {
                    switch (n) {
                    case 1: int8_row(xs, 1, in, q, sc, of, 32, su, groups, part); break;
                    case 2: int8_row(xs, 2, in, q, sc, of, 32, su, groups, part); break;
                    case 3: int8_row(xs, 3, in, q, sc, of, 32, su, groups, part); break;
                    default: int8_row(xs, 4, in, q, sc, of, 32, su, groups, part); break;
                    }
                } else if (group == 16) { /* the k-quants' groups (Q2_K, Q3_K, Q6_K) */
                    switch (n) {
                    case 1: int8_row(xs, 1, in, q, sc, of, 16, su, groups, part); break;
                    case 2: int8_row(xs, 2, in, q, sc, of, 16, su, groups, part); break;
                    case 3: int8_row(xs, 3, in, q, sc, of, 16, su, groups, part); break;
                    default: int8_row(xs, 4, in, q, sc, of, 16, su, groups, part); break;
                    }
                } else {
                    switch (n) {
                    case 1: int8_row(xs, 1, in, q, sc, of, group, su, groups, part); break;
                    case 2: int8_row(xs, 2, in, q, sc, of, group, su, groups, part); break;
                    case 3: int8_row(xs, 3, in, q, sc, of, group, su, groups, part); break;
                    default: int8_row(xs, 4, in, q, sc, of, group, su, groups, part); break;
                    }
                }
                for (int64_t r = 0; r < n; r++) y[(r0 + r) * out + o] = part[r] + (bias ? bias[o] : 0.0f);
            }
        }
    }
}

/* The strips of `out` output rows (the unit the threads share), and whether the kernels take a
 * product of that shape: 0, or the nonzero status the products return. */
int64_t quant_strips(int64_t out) { return (out + STRIP - 1) / STRIP; }
int64_t quant_strip_rows(void) { return STRIP; }

int int4_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group) {
    return rows < 1 || out < 1 || group < 32 || group % 32 != 0 || in % group != 0;
}

int int8_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group) {
    return rows < 1 || out < 1 || group < LANES || group % LANES != 0 || in % group != 0;
}

/* sums [rows, in / group] for the strips of a product with offsets. */
void quant_group_sums_f32(const float *x, int64_t rows, int64_t in, int64_t group, float *sums) {
    group_sums(x, rows, in, group, sums);
}

int int4_matmul_f32(const float *x, int64_t rows, int64_t in, const uint8_t *data, const float *scales,
                    const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads) {
    if (int4_shape_status(rows, in, out, group)) return 1;
    int64_t groups = in / group;
    float *sums = malloc(sizeof(float) * rows * groups);
    if (!sums) return 2;
    group_sums(x, rows, in, group, sums);
    int64_t strips = quant_strips(out);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t s = 0; s < strips; s++)
        int4_matmul_strips_f32(x, rows, in, data, scales, offsets, out, group, bias, y, sums, s, s + 1);
    free(sums);
    return 0;
}

int int8_matmul_f32(const float *x, int64_t rows, int64_t in, const int8_t *data, const float *scales,
                    const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads) {
    if (int8_shape_status(rows, in, out, group)) return 1;
    float *sums = NULL;
    if (offsets) {
        sums = malloc(sizeof(float) * rows * (in / group));
        if (!sums) return 2;
        group_sums(x, rows, in, group, sums);
    }
    int64_t strips = quant_strips(out);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t s = 0; s < strips; s++)
        int8_matmul_strips_f32(x, rows, in, data, scales, offsets, out, group, bias, y, sums, s, s + 1);
    free(sums);
    return 0;
}

/* w [out, in] fp32 from int4 weights: scale * q, rounded, plus offset, rounded, as the reference
 * computes it (no fused multiply-add). */
__attribute__((optimize("fp-contract=off"))) int int4_dequantize_f32(const uint8_t *data, const float *scales, const float *offsets, int64_t out, int64_t in,
                        int64_t group, float *w, int threads) {
    if (out < 1 || group < 32 || group % 32 != 0 || in % group != 0) return 1;
    int64_t groups = in / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        for (int64_t g = 0; g < groups; g++) {
            vec s = splat(scales[o * groups + g]), m = splat(offsets[o * groups + g]);
            for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
                vec q[4];
                nibbles32(data + o * (in / 2) + i / 2, q);
                float *dst = w + o * in + i;
                for (int j = 0; j < 4; j++) store(dst + 8 * j, s * q[j] + m);
            }
        }
    }
    return 0;
}

/* w [out, in] fp32 from int8 weights: scale * q, rounded, plus the offset (if any), rounded. */
__attribute__((optimize("fp-contract=off"))) int int8_dequantize_f32(const int8_t *data, const float *scales,
                                                                     const float *offsets, int64_t out, int64_t in,
                                                                     int64_t group, float *w, int threads) {
    if (out < 1 || group < LANES || group % LANES != 0 || in % group != 0) return 1;
    int64_t groups = in / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        for (int64_t g = 0; g < groups; g++) {
            vec s = splat(scales[o * groups + g]);
            if (offsets) {
                vec m = splat(offsets[o * groups + g]);
                for (int64_t i = g * group; i < (g + 1) * group; i += LANES)
                    store(w + o * in + i, s * int8s(data + o * in + i) + m);
            } else {
                for (int64_t i = g * group; i < (g + 1) * group; i += LANES)
                    store(w + o * in + i, s * int8s(data + o * in + i));
            }
        }
    }
    return 0;
}

/* ---- Many rows: the product as a GEMM --------------------------------------------------------
 *
 * Past a few rows, converting each weight once per tile of four rows (the products above) costs
 * more than the multiply-adds. Here a strip of GEMM_STRIP weight rows is dequantized once, exactly
 * as *_dequantize_f32 writes it, into a buffer of the calling thread, and every row of x runs
 * against it: tiles of GEMM_MR rows of x by GEMM_NR weight rows, one vector accumulator per
 * (row, weight row) pair, summed across its lanes at the end of the block. The input is taken in
 * blocks of about GEMM_KBLOCK columns (whole groups) so that the strip's buffer stays in the
 * core's cache whatever the width. Strips are shared among the threads.
 */
#ifndef GEMM_MR /* (the tile's sizes can be set at build time to measure others) */
#if WL == 16
#define GEMM_MR 4 /* 16 accumulators + 4 weight vectors of the 32 registers */
#define GEMM_NR 4
#else
#define GEMM_MR 4 /* 12 accumulators + 3 weight vectors of the 16 registers; x read from memory */
#define GEMM_NR 3
#endif
#endif
#define GEMM_STRIP (4 * GEMM_NR)
#ifndef GEMM_KBLOCK
#define GEMM_KBLOCK 1024
#endif

/* Columns [first, first + width) of weight row o, dequantized into dst (whole groups) in the
 * products' widest vectors, scale * q + offset as one multiply-add: within one rounding of
 * *_dequantize_f32's two, and half the work. */
static void dequantize_span(const void *data, int int4, const float *scales, const float *offsets, int64_t in,
                            int64_t group, int64_t o, int64_t first, int64_t width, float *dst) {
    int64_t groups = in / group;
    for (int64_t g = first / group; g < (first + width) / group; g++) {
        wvec s = wsplat(scales[o * groups + g]), m = wsplat(offsets ? offsets[o * groups + g] : 0.0f);
        float *out = dst + g * group - first;
        if (int4) {
            const uint8_t *q = (const uint8_t *)data + o * (in / 2) + g * group / 2;
            for (int64_t i = 0; i < group; i += 32) {
                wvec w[32 / WL];
                wnibbles32(q + i / 2, w);
                for (int j = 0; j < 32 / WL; j++) *(wvec_u *)(out + i + j * WL) = s * w[j] + m;
            }
        } else {
            const int8_t *q = (const int8_t *)data + o * in + g * group;
            int64_t i = 0;
            for (; i + WL <= group; i += WL) *(wvec_u *)(out + i) = s * wint8s(q + i) + m;
            for (; i < group; i += LANES) /* a group's tail of 8 on wide vectors */
                store(out + i, splat(scales[o * groups + g]) * int8s(q + i) + splat(offsets ? offsets[o * groups + g] : 0.0f));
        }
    }
}

/* Four accumulators' sums, each across its lanes, into sums[0..3]: one tree for the four (about
 * a third of four separate sums' shuffles). */
#if defined(__AVX2__)
static inline void hsum4(wvec a, wvec b, wvec c, wvec d, float *sums) {
#if WL == 16 /* fold each 16 lanes to 8 first */
#define HALVES(v) _mm256_add_ps(_mm512_castps512_ps256((__m512)v), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)))
    __m256 a8 = HALVES(a), b8 = HALVES(b), c8 = HALVES(c), d8 = HALVES(d);
#undef HALVES
#else
    __m256 a8 = (__m256)a, b8 = (__m256)b, c8 = (__m256)c, d8 = (__m256)d;
#endif
    /* [a01 a23 b01 b23 | a45 a67 b45 b67], the same for c and d, then [a b c d | a b c d] */
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#else
static inline void hsum4(wvec a, wvec b, wvec c, wvec d, float *sums) {
    sums[0] = whsum(a), sums[1] = whsum(b), sums[2] = whsum(c), sums[3] = whsum(d);
}
#endif

/* mr rows of x (`in` apart) against nr rows of the strip's buffer (`stride` apart) over `width`
 * columns (a multiple of 8); y[r, c] (`out` apart) is set (`first`) or added to. Always inlined
 * with constant mr and nr, so that the accumulators live in registers. */
INLINE void gemm_tile(const float *x, int64_t in, const float *w, int64_t stride, int64_t width, int64_t mr,
                      int64_t nr, float *y, int64_t out, int first) {
    wvec acc[GEMM_MR][GEMM_NR];
    for (int64_t r = 0; r < mr; r++)
        for (int64_t c = 0; c < nr; c++) acc[r][c] = wsplat(0.0f);
    int64_t k = 0;
    for (; k + WL <= width; k += WL) {
        wvec wv[GEMM_NR];
        for (int64_t c = 0; c < nr; c++) wv[c] = wload(w + c * stride + k);
        for (int64_t r = 0; r < mr; r++) {
            wvec xv = wload(x + r * in + k);
            for (int64_t c = 0; c < nr; c++) acc[r][c] += xv * wv[c];
        }
    }
    if (k < width) { /* 8 columns left (the low half of a wide vector) */
        wvec wv[GEMM_NR];
        for (int64_t c = 0; c < nr; c++) wv[c] = wload_low(w + c * stride + k);
        for (int64_t r = 0; r < mr; r++) {
            wvec xv = wload_low(x + r * in + k);
            for (int64_t c = 0; c < nr; c++) acc[r][c] += xv * wv[c];
        }
    }
    for (int64_t r = 0; r < mr; r++) {
        float sums[GEMM_NR > 4 ? GEMM_NR : 4];
        int64_t c = 0;
        for (; c + 4 <= nr; c += 4) hsum4(acc[r][c], acc[r][c + 1], acc[r][c + 2], acc[r][c + 3], sums + c);
        for (; c < nr; c++) sums[c] = whsum(acc[r][c]);
        for (c = 0; c < nr; c++) {
            if (first) y[r * out + c] = sums[c];
            else y[r * out + c] += sums[c];
        }
    }
}

/* The tile at rows of x (mr of them) and weight rows (nr), with mr and nr made constants. */
#if GEMM_MR > 4
#define GEMM_ROWS_PAST_4(NR)                                                                 \
    case 4: gemm_tile(x, in, w, stride, width, 4, NR, y, out, first); break;                 \
    case 5: gemm_tile(x, in, w, stride, width, 5, NR, y, out, first); break;
#else
#define GEMM_ROWS_PAST_4(NR)
#endif
static void gemm_tile_any(const float *x, int64_t in, const float *w, int64_t stride, int64_t width, int64_t mr,
                          int64_t nr, float *y, int64_t out, int first) {
#define GEMM_ROWS(NR)                                                                        \
    switch (mr) {                                                                            \
    case 1: gemm_tile(x, in, w, stride, width, 1, NR, y, out, first); break;                 \
    case 2: gemm_tile(x, in, w, stride, width, 2, NR, y, out, first); break;                 \
    case 3: gemm_tile(x, in, w, stride, width, 3, NR, y, out, first); break;                 \
    GEMM_ROWS_PAST_4(NR)                                                                     \
    default: gemm_tile(x, in, w, stride, width, GEMM_MR, NR, y, out, first); break;          \
    }
    switch (nr) {
    case 1: GEMM_ROWS(1) break;
    case 2: GEMM_ROWS(2) break;
#if GEMM_NR > 3
    case 3: GEMM_ROWS(3) break;
#endif
    default: GEMM_ROWS(GEMM_NR) break;
    }
#undef GEMM_ROWS
}

/* y [rows, out] = x [rows, in] times int4 (`int4`: uint8 data, offsets required) or int8 (int8
 * data, offsets optional) weights, + bias. 0, or nonzero for shapes it does not take or when
 * memory runs out. */
int quant_gemm_f32(const float *x, int64_t rows, int64_t in, const void *data, int int4, const float *scales,
                   const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads) {
    if ((int4 ? int4_shape_status(rows, in, out, group) : int8_shape_status(rows, in, out, group)) ||
        (int4 && !offsets))
        return 1;
    int64_t block = group * (GEMM_KBLOCK / group > 1 ? GEMM_KBLOCK / group : 1);
    if (block > in) block = in;
    /* The buffer's rows one cache line more than a block apart: rows a power of two apart would
     * share the cache's sets, and the tile reads several of them at once. */
#ifndef GEMM_ROW_PAD
#define GEMM_ROW_PAD 16
#endif
    int64_t stride = block + GEMM_ROW_PAD;
    int64_t strips = (out + GEMM_STRIP - 1) / GEMM_STRIP, row_bytes = int4 ? in / 2 : in;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buffer = aligned_alloc(64, sizeof(float) * GEMM_STRIP * stride);
        if (!buffer) failed = 1;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; s++) {
            if (!buffer) continue;
            int64_t o0 = s * GEMM_STRIP, strip = out - o0 < GEMM_STRIP ? out - o0 : GEMM_STRIP;
            /* The next strip's weights (contiguous bytes), fetched from memory while this one's
             * multiply-adds run: dequantizing then finds them in cache. */
            if (s + 1 < strips) {
                const char *next = (const char *)data + (o0 + GEMM_STRIP) * row_bytes;
                int64_t next_rows = out - o0 - GEMM_STRIP < GEMM_STRIP ? out - o0 - GEMM_STRIP : GEMM_STRIP;
                for (int64_t b = 0; b < next_rows * row_bytes; b += 64) __builtin_prefetch(next + b, 0, 1);
            }
            for (int64_t k0 = 0; k0 < in; k0 += block) {
                int64_t width = in - k0 < block ? in - k0 : block;
                for (int64_t c = 0; c < strip; c++)
                    dequantize_span(data, int4, scales, offsets, in, group, o0 + c, k0, width, buffer + c * stride);
                for (int64_t r0 = 0; r0 < rows; r0 += GEMM_MR) {
                    int64_t mr = rows - r0 < GEMM_MR ? rows - r0 : GEMM_MR;
                    for (int64_t c0 = 0; c0 < strip; c0 += GEMM_NR) {
                        int64_t nr = strip - c0 < GEMM_NR ? strip - c0 : GEMM_NR;
                        gemm_tile_any(x + r0 * in + k0, in, buffer + c0 * stride, stride, width, mr, nr,
                                      y + r0 * out + o0 + c0, out, k0 == 0);
                    }
                }
            }
            if (bias)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < strip; c++) y[r * out + o0 + c] += bias[o0 + c];
        }
        free(buffer);
    }
    return failed ? 2 : 0;
}

/* ---- Products with 8-bit activations (opt-in, lossy: llama.cpp's numerics) ----------------
 *
 * Each row of x is rounded to int8 in blocks of 32 with one fp32 scale per block
 * (xq = round(x / d), d = max|x| / 127, halves to even), and each block of weights is multiplied
 * with it in integers: the 32 products of a block sum exactly in int32, then are scaled once by
 * d * scale_g. Offsets add offset_g * sum(x_g) with the exact fp32 sums of x. Groups must be whole
 * blocks of 32. On AVX2 a block is one unsigned-by-signed byte multiply (int4 weights are 0..15;
 * int8 weights go through their absolute value, the sign moved onto x) and one widening add.
 */

/* xq [rows, in] int8 and d [rows, in / 32] from x. */
static void quantize_rows_q8(const float *x, int64_t rows, int64_t in, int8_t *xq, float *d) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < in / 32; b++) {
            const float *p = x + r * in + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = p[i] > amax ? p[i] : (-p[i] > amax ? -p[i] : amax);
            float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[r * (in / 32) + b] = scale;
            /* Rounded to nearest, halves to even: one exact operation on the rounded quotient, so
             * no multiply-add contraction can move a tie (the torch twin rounds the same). */
            for (int i = 0; i < 32; i++) xq[r * in + b * 32 + i] = (int8_t)nearbyintf(p[i] * inverse);
        }
}

/* The integer dot product of one block of 32 weights with 32 int8 activations. */
#if defined(__AVX2__)
static inline __m256i int4_block_dot(const uint8_t *q, const int8_t *xq) {
    __m128i v = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    __m256i pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xq));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static inline __m256i int8_block_dot(const int8_t *q, const int8_t *xq) {
    __m256i w = _mm256_loadu_si256((const __m256i *)q), a = _mm256_loadu_si256((const __m256i *)xq);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

/* The same without AVX2: `block` is the block's 16 (int4) or 32 (int8) bytes. */
static inline int32_t block_dot_scalar(const void *block, int int4, const int8_t *xq) {
    int32_t acc = 0;
    for (int j = 0; j < 32; j++) {
        int w;
        if (int4) {
            uint8_t byte = ((const uint8_t *)block)[j & 15];
            w = j < 16 ? byte & 15 : byte >> 4;
        } else {
            w = ((const int8_t *)block)[j];
        }
        acc += w * xq[j];
    }
    return acc;
}

/* One weight row against n (1..TILE) rows of quantized x `in` apart: each block of weights is
 * loaded (and its nibbles split) once for the n rows. out[r] as for one row. */
INLINE void q8x_rows(const int8_t *xq, const float *d, int64_t n, int64_t in, const void *q, int int4,
                     const float *scale, const float *offset, int64_t group, const float *sums, float *out) {
    int64_t groups = in / group, per_group = group / 32, blocks = in / 32;
#if defined(__AVX2__)
    __m256 total[2][TILE]; /* even and odd blocks: two multiply-add chains a row */
    for (int64_t r = 0; r < n; r++) total[0][r] = total[1][r] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0, b = 0; g < groups; g++)
        for (int64_t end = b + per_group; b < end; b++) {
            __m256i w, sign = _mm256_setzero_si256();
            if (int4) {
                __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * 16));
                w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
            } else {
                sign = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * 32));
                w = _mm256_sign_epi8(sign, sign);
            }
            for (int64_t r = 0; r < n; r++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * in + b * 32));
                if (!int4) a = _mm256_sign_epi8(a, sign);
                __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
                __m256 s = _mm256_set1_ps(d[r * blocks + b] * scale[g]);
                if (b & 1) total[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, total[1][r]);
                else total[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, total[0][r]);
            }
        }
    for (int64_t r = 0; r < n; r++) out[r] = hsum((vec)_mm256_add_ps(total[0][r], total[1][r]));
#else
    for (int64_t r = 0; r < n; r++) {
        out[r] = 0.0f;
        for (int64_t g = 0, b = 0; g < groups; g++)
            for (int64_t end = b + per_group; b < end; b++)
                out[r] += (float)block_dot_scalar((const uint8_t *)q + b * (int4 ? 16 : 32), int4, xq + r * in + b * 32) *
                          (d[r * blocks + b] * scale[g]);
    }
#endif
    if (offset)
        for (int64_t r = 0; r < n; r++) out[r] += dot(offset, sums + r * groups, groups);
}

/* y [rows, out] = x [rows, in] times int4 (`int4`, uint8 data with offsets) or int8 (int8
 * data, offsets optional) weights, with x rounded to int8 as above. 0, or nonzero for shapes it
 * does not take (groups not whole blocks of 32) or when memory runs out. */
int quant_matmul_q8x_f32(const float *x, int64_t rows, int64_t in, const void *data, int int4, const float *scales,
                         const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads) {
    if (rows < 1 || out < 1 || group < 32 || group % 32 != 0 || in % group != 0 || (int4 && !offsets)) return 1;
    int64_t groups = in / group, row_bytes = int4 ? in / 2 : in;
    int8_t *xq = malloc(rows * in);
    float *d = malloc(sizeof(float) * rows * (in / 32));
    float *sums = offsets ? malloc(sizeof(float) * rows * groups) : NULL;
    if (!xq || !d || (offsets && !sums)) {
        free(xq), free(d), free(sums);
        return 2;
    }
    quantize_rows_q8(x, rows, in, xq, d);
    if (offsets) group_sums(x, rows, in, group, sums);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *q = (const uint8_t *)data + o * row_bytes;
        const float *sc = scales + o * groups, *of = offsets ? offsets + o * groups : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int64_t n = rows - r0 < TILE ? rows - r0 : TILE;
            const int8_t *xr = xq + r0 * in;
            const float *dr = d + r0 * (in / 32), *su = offsets ? sums + r0 * groups : NULL;
            float part[TILE];
            /* the common shapes as constants, so that the block loop has no branches */
#define Q8X_CASE(N)                                                                  \
    if (int4 && group == 32) q8x_rows(xr, dr, N, in, q, 1, sc, of, 32, su, part);    \
    else if (int4) q8x_rows(xr, dr, N, in, q, 1, sc, of, group, su, part);           \
    else if (group == 32) q8x_rows(xr, dr, N, in, q, 0, sc, of, 32, su, part);       \
    else q8x_rows(xr, dr, N, in, q, 0, sc, of, group, su, part);
            switch (n) {
            case 1: Q8X_CASE(1) break;
            case 2: Q8X_CASE(2) break;
            case 3: Q8X_CASE(3) break;
            default: Q8X_CASE(4) break;
            }
#undef Q8X_CASE
            for (int64_t r = 0; r < n; r++) y[(r0 + r) * out + o] = part[r] + (bias ? bias[o] : 0.0f);
        }
    }
    free(xq), free(d), free(sums);
    return 0;
}
