/* Decode attention over a paged KV cache in fp32: the CPU backend's one native kernel.
 *
 * Each sequence adds one token. paged_decode_attention_f32 first stores the new tokens' K and V
 * in their slots, then attends each query over its sequence's first lens[s] slots, found
 * through its block table. With a sliding window W > 0 a query attends only the last W of
 * them (keys lens[s] - W .. lens[s] - 1): the chunks start at the window, so the work is
 * bounded by the window and the pages before it are never read. With a soft-cap c > 0 each
 * score s becomes c * tanh(s / c) before the softmax. The work is split into (sequence, chunk
 * of keys) items, so that one sequence alone still keeps every core busy. An item reads each of its key and value rows (all
 * KV heads, contiguous in the page) once, front to back, which the hardware prefetchers follow;
 * for every query head it keeps the maximum score, the sum of exponentials and the unnormalised
 * weighted sum of values. A second pass merges the chunks of each query head.
 *
 * Vectors are GCC/Clang vector extensions of 8 floats (AVX2 registers on x86, pairs of NEON
 * registers on ARM); nothing here is specific to one instruction set.
 *
 * Layouts (contiguous, row-major):
 *   q       [seqs, heads, dim]           k, v  [seqs, kv_heads, dim]    slots [seqs] int64
 *   cache   [pages, 2, page_size, kv_heads, dim]   (K then V within a page)
 *   tables  [seqs, table_width] int32    lens  [seqs] int32, 1 <= lens[s] <= table_width * page_size
 *   scratch [seqs, chunks, heads, dim + 2], chunks * chunk >= the longest span a query attends
 *           (its length, or at most the window)
 *   out     [seqs, heads, dim]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
 * each key row (all KV heads, contiguous) once. `scores` holds heads x MAX_CHUNK floats. Writes,
 * per query head, dim sums then the maximum score then the total. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *qs, const float *cache, const int32_t *table, int64_t start, int64_t end,
    int64_t heads, int64_t group, const int64_t dim, int64_t kv_heads, int64_t page_size,
    float scale, float soft_cap, float *scores, float *part) {
    const int64_t row = kv_heads * dim, page = 2 * page_size * row, n = end - start;
    const int64_t stride = MAX_CHUNK + LANES; /* floats per query head in `scores` */

    /* Scores, eight keys at a time within a page, their eight dot products summed in one go. */
    for (int64_t t = start; t < end;) {
        const float *k = cache + (int64_t)table[t / page_size] * page + (t % page_size) * row;
        const int64_t in_page = page_size - t % page_size, left = end - t;
        const int64_t rows = in_page < left ? in_page : left;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8) {
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *q = qs + hq * dim, *k0 = k + r * row + hq / group * dim;
                vec a[8];
                for (int j = 0; j < 8; j++) a[j] = splat(0.0f);
                for (int64_t i = 0; i < dim; i += LANES) {
                    const vec x = load(q + i);
                    for (int j = 0; j < 8; j++) a[j] += x * load(k0 + j * row + i);
                }
                store(scores + hq * stride + (t - start) + r, sums8(a) * splat(scale));
            }
        }
        for (; r < rows; r++) {
            for (int64_t hq = 0; hq < heads; hq++) {
                const float *q = qs + hq * dim, *k0 = k + r * row + hq / group * dim;
                vec a0 = splat(0.0f);
                for (int64_t i = 0; i < dim; i += LANES) a0 += load(q + i) * load(k0 + i);
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
            const float *v = cache + (int64_t)table[t / page_size] * page + page_size * row + (t % page_size) * row + hq / group * dim;
            const int64_t in_page = page_size - t % page_size, left = end - t;
            const int64_t rows = in_page < left ? in_page : left;
            for (int64_t r = 0; r < rows; r++) {
                const vec w = splat(p[t - start + r]);
                for (int64_t i = 0; i < dim / LANES; i++) acc[i] += w * load(v + r * row + i * LANES);
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

/* Returns 0; 1 when the shapes are outside what this kernel handles (nothing is written), 2 when
 * it could not allocate its score buffers (the cache holds the new K/V, the output is unset). */
int paged_decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                               float *cache, const int32_t *tables, int64_t table_width,
                               const int32_t *lens, int64_t seqs, int64_t heads, int64_t kv_heads,
                               int64_t dim, int64_t page_size, int64_t chunk, int64_t chunks,
                               float scale, int64_t window, float soft_cap, float *scratch,
                               float *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > MAX_HEADS || dim % LANES != 0 ||
        dim > MAX_DIM || chunk <= 0 || chunk > MAX_CHUNK || chunk % page_size != 0 || window < 0)
        return 1;
    const int64_t group = heads / kv_heads, row = kv_heads * dim, page = 2 * page_size * row;
    const int64_t item = heads * (dim + 2), items = seqs * chunks;
    int failed = 0;

    for (int64_t s = 0; s < seqs; s++) {
        float *slot = cache + (slots[s] / page_size) * page + (slots[s] % page_size) * row;
        memcpy(slot, k + s * row, row * sizeof(float));
        memcpy(slot + page_size * row, v + s * row, row * sizeof(float));
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
            if (dim == 64)
                attend_chunk(qs, cache, table, start, end, heads, group, 64, kv_heads, page_size, scale, soft_cap, scores, part);
            else if (dim == 128)
                attend_chunk(qs, cache, table, start, end, heads, group, 128, kv_heads, page_size, scale, soft_cap, scores, part);
            else
                attend_chunk(qs, cache, table, start, end, heads, group, dim, kv_heads, page_size, scale, soft_cap, scores, part);
        }
        free(scores);
    }
    if (failed) return failed;

#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t sh = 0; sh < seqs * heads; sh++) {
        const int64_t s = sh / heads, hq = sh % heads;
        const float *first = scratch + s * chunks * item + hq * (dim + 2);
        float top = 0.0f;
        int seen = 0;
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = first + c * item;
            if (part[dim + 1] != 0.0f && (!seen || part[dim] > top)) top = part[dim], seen = 1;
        }
        float *o = out + sh * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        float total = 0.0f;
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
