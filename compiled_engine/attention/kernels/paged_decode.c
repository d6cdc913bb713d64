/* Decode attention over a paged KV cache: the CPU backend's one native kernel. Queries, new K/V and
 * the output are fp32; the pages hold fp32, fp16, bf16, fp8 e4m3 or fp8 e5m2 (`kv_type`), converted
 * to fp32 in registers as they are read, so a smaller type reads fewer bytes per step.
 *
 * Each sequence adds one token. paged_decode_attention first stores the new tokens' K and V
 * in their slots, then attends each query over its sequence's first lens[s] slots, found
 * through its block table. With a sliding window W > 0 a query attends only the last W of
 * them (keys lens[s] - W .. lens[s] - 1): the chunks start at the window, so the work is
 * bounded by the window and the pages before it are never read. With a soft-cap c > 0 each
 * score s becomes c * tanh(s / c) before the softmax. With attention sinks (`sinks`, one logit per
 * query head, or NULL) each head's softmax denominator also holds exp(sink), with no value: the
 * merge of the chunks adds it, so the chunks never see it. The work is split into (sequence, chunk
 * of keys) items, so that one sequence alone still keeps every core busy. An item reads each of its key and value rows (all
 * KV heads, contiguous in the page) once, front to back, which the hardware prefetchers follow;
 * for every query head it keeps the maximum score, the sum of exponentials and the unnormalised
 * weighted sum of values. A second pass merges the chunks of each query head.
 *
 * Vectors are GCC/Clang vector extensions of 8 floats (AVX2 registers on x86, pairs of NEON
 * registers on ARM); nothing here is specific to one instruction set.
 *
 * Stores round to nearest even, as torch's `.to(dtype)` does, bit for bit; the FP8 types first
 * saturate to their largest finite value (a per-tensor scale of 1.0), so a K or V beyond the
 * type's range is stored as +-max (NaN stays NaN).
 *
 * Layouts (contiguous, row-major):
 *   q       [seqs, heads, dim]           k, v  [seqs, kv_heads, dim]    slots [seqs] int64
 *   cache   [pages, 2, page_size, kv_heads, dim] of kv_type   (K then V within a page)
 *   tables  [seqs, table_width] int32    lens  [seqs] int32, 1 <= lens[s] <= table_width * page_size
 *   scratch [seqs, chunks, heads, dim + 2], chunks * chunk >= the longest span a query attends
 *           (its length, or at most the window)
 *   out     [seqs, heads, dim]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_CHUNK 512
#define MAX_HEADS 128
#define MAX_DIM 256
#define LANES 8

typedef float vec __attribute__((vector_size(32)));
typedef int32_t ivec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4))); /* unaligned memory */

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline void store(float *p, vec x) { *(vec_u *)p = x; }
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
static inline float sum(vec x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

/* The eight sums of a[0..7], as one vector: pairwise shuffles within 128-bit halves first, one
 * exchange of halves last (the order AVX2 shuffles cheaply). */
static inline vec sums8(const vec a[8]) {
    vec pair[4], quad[2];
    for (int j = 0; j < 4; j++)
        pair[j] = SHUFFLE(a[2 * j], a[2 * j + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
                  SHUFFLE(a[2 * j], a[2 * j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int j = 0; j < 2; j++)
        quad[j] = SHUFFLE(pair[2 * j], pair[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                  SHUFFLE(pair[2 * j], pair[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* ---- KV element types ------------------------------------------------------------------------ */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

typedef uint32_t uvec __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x8_u __attribute__((vector_size(16), aligned(1)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8_u __attribute__((vector_size(8), aligned(1)));

static inline uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static inline float bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Eight fp16 values as fp32: F16C where the compiler targets it, else the exponent rebias below
 * (subnormals through one float subtraction, infinities and NaNs kept). */
static inline vec f16x8_to_f32(u16x8 h) {
#if defined(__F16C__)
    return (vec)_mm256_cvtph_ps((__m128i)h);
#else
    const uvec x = __builtin_convertvector(h, uvec);
    uvec o = (x & 0x7fffu) << 13;
    const uvec e = o & (0x7c00u << 13);
    o += (127u - 15u) << 23;
    o += (uvec)(e == (0x7c00u << 13)) & ((128u - 16u) << 23); /* infinities and NaNs */
    const uvec small = (uvec)(e == 0u);                         /* zeros and subnormals */
    o += small & (1u << 23);
    const uvec fixed = (uvec)((vec)o - splat(0x1p-14f));
    o = (fixed & small) | (o & ~small);
    return (vec)(o | ((x & 0x8000u) << 16));
#endif
}

/* Eight K or V values from a page of `type`, element index i, as fp32. */
static inline __attribute__((always_inline)) vec load_kv(const void *base, int64_t i, int type) {
    if (type == KV_F32) return load((const float *)base + i);
    if (type == KV_F16) return f16x8_to_f32(*(const u16x8_u *)((const uint16_t *)base + i));
    if (type == KV_BF16) {
        const uvec x = __builtin_convertvector(*(const u16x8_u *)((const uint16_t *)base + i), uvec);
        return (vec)(x << 16);
    }
    const u16x8 b = __builtin_convertvector(*(const u8x8_u *)((const uint8_t *)base + i), u16x8);
    if (type == KV_E5M2) return f16x8_to_f32(b << 8); /* e5m2 is the top byte of an fp16 */
    /* e4m3 (no infinities; 0x7f and 0xff are NaN): its exponent and mantissa placed in an fp16's
     * give the value times 2^-8, subnormals included; then the NaNs made NaN. */
    const u16x8 magnitude = b & 0x7f;
    const vec x = f16x8_to_f32((magnitude << 7) | ((b & 0x80) << 8)) * splat(256.0f);
    const uvec nan = (uvec)__builtin_convertvector(magnitude == 0x7f, ivec);
    return (vec)((uvec)x | (nan & 0x7fc00000u));
}

/* One fp32 value stored as `type`, rounded to nearest even: the conversions of c10 (torch's
 * `.to(dtype)` on the CPU), with the FP8 types saturated to +-max first. */
static inline uint16_t f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = float_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007c00u, mantissa_bits = bits & 0x00000fffu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

static inline uint16_t f32_to_bf16(float f) {
    if (isnan(f)) return 0x7fc0;
    const uint32_t u = float_bits(f);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint8_t f32_to_e4m3(float f) {
    if (f > 448.0f) f = 448.0f;
    if (f < -448.0f) f = -448.0f;
    uint32_t bits = float_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    uint8_t result;
    bits ^= sign;
    if (bits >= 1087u << 20) { /* NaN */
        result = 0x7f;
    } else if (bits < 121u << 23) { /* below 2^-6, the smallest normal: a subnormal or zero */
        const uint32_t denorm = 141u << 23;
        result = (uint8_t)(float_bits(bits_float(bits) + bits_float(denorm)) - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

static inline uint8_t f32_to_e5m2(float f) {
    if (f > 57344.0f) f = 57344.0f;
    if (f < -57344.0f) f = -57344.0f;
    uint32_t bits = float_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    uint8_t result;
    bits ^= sign;
    if (bits >= 143u << 23) { /* NaN (infinities were saturated) */
        result = bits > 255u << 23 ? 0x7f : 0x7c;
    } else if (bits < 113u << 23) { /* below 2^-14, the smallest normal */
        const uint32_t denorm = 134u << 23;
        result = (uint8_t)(float_bits(bits_float(bits) + bits_float(denorm)) - denorm);
    } else {
        const uint32_t odd = (bits >> 21) & 1u;
        bits += ((uint32_t)(15 - 127) << 23) + 0xfffffu + odd;
        result = (uint8_t)(bits >> 21);
    }
    return result | (uint8_t)(sign >> 24);
}

/* n fp32 values stored as `type` at element index i of `base`. */
static void store_kv(void *base, int64_t i, const float *x, int64_t n, int type) {
    if (type == KV_F32) {
        memcpy((float *)base + i, x, n * sizeof(float));
    } else if (type == KV_F16) {
        for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = f32_to_f16(x[j]);
    } else if (type == KV_BF16) {
        for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = f32_to_bf16(x[j]);
    } else if (type == KV_E4M3) {
        for (int64_t j = 0; j < n; j++) ((uint8_t *)base)[i + j] = f32_to_e4m3(x[j]);
    } else {
        for (int64_t j = 0; j < n; j++) ((uint8_t *)base)[i + j] = f32_to_e5m2(x[j]);
    }
}

/* Converts n values of `type` into and out of fp32 (n a multiple of LANES going in): what the
 * tests check the conversions with. */
void paged_kv_from_f32(const float *x, void *out, int64_t n, int type) { store_kv(out, 0, x, n, type); }
void paged_kv_to_f32(const void *x, float *out, int64_t n, int type) {
    for (int64_t i = 0; i + LANES <= n; i += LANES) store(out + i, load_kv(x, i, type));
}

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^6
 * (relative error below 2e-7), times 2^n built in the exponent bits. Below -87 it returns
 * exp(-87) ~ 1.6e-38 instead of a denormal or zero. */
static inline vec exp_nonpositive(vec x) {
    const ivec low = x < splat(-87.0f);
    x = (vec)(((ivec)x & ~low) | ((ivec)splat(-87.0f) & low));
    const vec shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vec n = (x * splat(1.44269504f) + shifter) - shifter;
    const vec r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);
    vec p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return p * (vec)bits;
}

/* One work item: every query head of one sequence against its keys start .. end-1, reading
 * each key row (all KV heads, contiguous) once. The cache holds `type`: offsets below count
 * elements, and load_kv converts what it reads. `scores` holds heads x MAX_CHUNK floats. Writes,
 * per query head, dim sums then the maximum score then the total. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *qs, const void *cache, const int type, const int32_t *table, int64_t start, int64_t end,
    int64_t heads, int64_t group, const int64_t dim, int64_t kv_heads, int64_t page_size,
    float scale, float soft_cap, float *scores, float *part) {
    const int64_t row = kv_heads * dim, page = 2 * page_size * row, n = end - start;
    const int64_t stride = MAX_CHUNK + LANES; /* floats per query head in `scores` */

    /* Scores, eight keys at a time within a page, their eight dot products summed in one go. */
    for (int64_t t = start; t < end;) {
        const int64_t k = (int64_t)table[t / page_size] * page + (t % page_size) * row;
        const int64_t in_page = page_size - t % page_size, left = end - t;
        const int64_t rows = in_page < left ? in_page : left;
        int64_t r = 0;
        if (type != KV_F32) {
            /* Eight keys of one KV head converted once, then scored against each query head of its
             * group (a group of g heads would otherwise convert them g times). */
            for (; r + 8 <= rows; r += 8) {
                for (int64_t g = 0; g < kv_heads; g++) {
                    float converted[8 * MAX_DIM] __attribute__((aligned(32)));
                    for (int j = 0; j < 8; j++)
                        for (int64_t i = 0; i < dim; i += LANES)
                            store(converted + j * dim + i, load_kv(cache, k + (r + j) * row + g * dim + i, type));
                    for (int64_t hq = g * group; hq < (g + 1) * group; hq++) {
                        const float *q = qs + hq * dim;
                        vec a[8];
                        for (int j = 0; j < 8; j++) a[j] = splat(0.0f);
                        for (int64_t i = 0; i < dim; i += LANES) {
                            const vec x = load(q + i);
                            for (int j = 0; j < 8; j++) a[j] += x * load(converted + j * dim + i);
                        }
                        store(scores + hq * stride + (t - start) + r, sums8(a) * splat(scale));
                    }
                }
            }
        }
        for (; r + 8 <= rows; r += 8) {
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *q = qs + hq * dim;
                const int64_t k0 = k + r * row + hq / group * dim;
                vec a[8];
                for (int j = 0; j < 8; j++) a[j] = splat(0.0f);
                for (int64_t i = 0; i < dim; i += LANES) {
                    const vec x = load(q + i);
                    for (int j = 0; j < 8; j++) a[j] += x * load_kv(cache, k0 + j * row + i, type);
                }
                store(scores + hq * stride + (t - start) + r, sums8(a) * splat(scale));
            }
        }
        for (; r < rows; r++) {
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *q = qs + hq * dim;
                const int64_t k0 = k + r * row + hq / group * dim;
                vec a0 = splat(0.0f);
                for (int64_t i = 0; i < dim; i += LANES) a0 += load(q + i) * load_kv(cache, k0 + i, type);
                scores[hq * stride + (t - start) + r] = sum(a0) * scale;
            }
        }
        t += rows;
    }

    /* Softmax numerators; the padding up to a whole vector is zeroed after exp. */
    const int64_t padded = (n + LANES - 1) / LANES * LANES;
    for (int64_t hq = 0; hq < heads; hq++) {
        float *row_scores = scores + hq * stride;
        if (soft_cap > 0.0f) /* capped before the maximum is taken, as the softmax sees them */
            for (int64_t t = 0; t < n; t++) row_scores[t] = soft_cap * tanhf(row_scores[t] / soft_cap);
        float m = row_scores[0];
        for (int64_t t = 1; t < n; t++) m = row_scores[t] > m ? row_scores[t] : m;
        for (int64_t t = 0; t < padded; t += LANES) store(row_scores + t, exp_nonpositive(load(row_scores + t) - splat(m)));
        for (int64_t t = n; t < padded; t++) row_scores[t] = 0.0f;
        vec total = splat(0.0f);
        for (int64_t t = 0; t < padded; t += LANES) total += load(row_scores + t);
        part[hq * (dim + 2) + dim] = m;
        part[hq * (dim + 2) + dim + 1] = sum(total);
    }

    /* Weighted sum of values, one query head at a time, its dim sums held in registers. */
    for (int64_t hq = 0; hq < heads; hq++) {
        const float *p = scores + hq * stride;
        vec acc[MAX_DIM / LANES];
        for (int64_t i = 0; i < dim / LANES; i++) acc[i] = splat(0.0f);
        for (int64_t t = start; t < end;) {
            const int64_t v = (int64_t)table[t / page_size] * page + page_size * row + (t % page_size) * row + hq / group * dim;
            const int64_t in_page = page_size - t % page_size, left = end - t;
            const int64_t rows = in_page < left ? in_page : left;
            for (int64_t r = 0; r < rows; r++) {
                const vec w = splat(p[t - start + r]);
                for (int64_t i = 0; i < dim / LANES; i++) acc[i] += w * load_kv(cache, v + r * row + i * LANES, type);
            }
            t += rows;
        }
        for (int64_t i = 0; i < dim / LANES; i++) store(part + hq * (dim + 2) + i * LANES, acc[i]);
    }
}

/* Keys per work item: whole pages, at most MAX_CHUNK, and few enough that `work` sequences times
 * their chunks give each of `threads` threads four items where the span allows (the rule of
 * attention/native_decode.py's chunk_size, for callers that split the work here). */
int64_t paged_decode_chunk_keys(int64_t work, int64_t span, int64_t page_size, int64_t threads) {
    const int64_t sequences = work > 1 ? work : 1, wanted = (4 * threads + sequences - 1) / sequences;
    const int64_t keys = (span + wanted - 1) / wanted;
    const int64_t pages = (keys + page_size - 1) / page_size;
    const int64_t whole_pages = (pages > 1 ? pages : 1) * page_size, most = MAX_CHUNK / page_size * page_size;
    return whole_pages < most ? whole_pages : most;
}

/* The work items of one KV type: each dim the kernel is built for, the others through a loop. */
#define ATTEND_DIMS(TYPE)                                                                                        \
    do {                                                                                                          \
        if (dim == 64)                                                                                            \
            attend_chunk(qs, cache, TYPE, table, start, end, heads, group, 64, kv_heads, page_size, scale,        \
                         soft_cap, scores, part);                                                                 \
        else if (dim == 128)                                                                                      \
            attend_chunk(qs, cache, TYPE, table, start, end, heads, group, 128, kv_heads, page_size, scale,       \
                         soft_cap, scores, part);                                                                 \
        else                                                                                                      \
            attend_chunk(qs, cache, TYPE, table, start, end, heads, group, dim, kv_heads, page_size, scale,       \
                         soft_cap, scores, part);                                                                 \
    } while (0)

/* Returns 0; 1 when the shapes or the KV type are outside what this kernel handles (nothing is
 * written), 2 when it could not allocate its score buffers (the cache holds the new K/V, the
 * output is unset). `kv_type` is one of KV_F32, KV_F16, KV_BF16, KV_E4M3, KV_E5M2. */
int paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *slots,
                           void *cache, int kv_type, const int32_t *tables, int64_t table_width,
                           const int32_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t page_size, int64_t chunk, int64_t chunks,
                           float scale, int64_t window, float soft_cap, const float *sinks,
                           float *scratch, float *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > MAX_HEADS || dim % LANES != 0 ||
        dim > MAX_DIM || chunk <= 0 || chunk > MAX_CHUNK || chunk % page_size != 0 || window < 0 ||
        kv_type < KV_F32 || kv_type > KV_E5M2)
        return 1;
    const int64_t group = heads / kv_heads, row = kv_heads * dim, page = 2 * page_size * row;
    const int64_t item = heads * (dim + 2), items = seqs * chunks;
    int failed = 0;

    for (int64_t s = 0; s < seqs; s++) {
        const int64_t slot = (slots[s] / page_size) * page + (slots[s] % page_size) * row;
        store_kv(cache, slot, k + s * row, row, kv_type);
        store_kv(cache, slot + page_size * row, v + s * row, row, kv_type);
    }

#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(heads * (MAX_CHUNK + LANES) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            const int64_t s = w / chunks, c = w % chunks;
            float *part = scratch + w * item;
            /* Chunks count from the first key the query sees: 0, or the start of its window. */
            const int64_t first = window > 0 && lens[s] > window ? lens[s] - window : 0;
            const int64_t start = first + c * chunk, end = lens[s] < start + chunk ? lens[s] : start + chunk;
            if (start >= end || scores == NULL) {
                for (int64_t hq = 0; hq < heads; hq++) part[hq * (dim + 2) + dim + 1] = 0.0f;
                continue;
            }
            const float *qs = q + s * heads * dim;
            const int32_t *table = tables + s * table_width;
            switch (kv_type) {
            case KV_F32: ATTEND_DIMS(KV_F32); break;
            case KV_F16: ATTEND_DIMS(KV_F16); break;
            case KV_BF16: ATTEND_DIMS(KV_BF16); break;
            case KV_E4M3: ATTEND_DIMS(KV_E4M3); break;
            default: ATTEND_DIMS(KV_E5M2); break;
            }
        }
        free(scores);
    }
    if (failed) return failed;

#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t sh = 0; sh < seqs * heads; sh++) {
        const int64_t s = sh / heads, hq = sh % heads;
        const float *first = scratch + s * chunks * item + hq * (dim + 2);
        /* The sink joins the maximum and the total as one more score whose value is zero. */
        float top = sinks != NULL ? sinks[hq] : 0.0f;
        int seen = sinks != NULL;
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = first + c * item;
            if (part[dim + 1] != 0.0f && (!seen || part[dim] > top)) top = part[dim], seen = 1;
        }
        float *o = out + sh * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        float total = sinks != NULL ? exp_nonpositive(splat(sinks[hq] - top))[0] : 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = first + c * item;
            if (part[dim + 1] == 0.0f) continue;
            const float weight = exp_nonpositive(splat(part[dim] - top))[0];
            total += part[dim + 1] * weight;
            for (int64_t d = 0; d < dim; d++) o[d] += part[d] * weight;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < dim; d++) o[d] *= inv;
    }
    return 0;
}
