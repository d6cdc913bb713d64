/* Products of a few fp32 rows with an fp32 weight kept in oneDNN's blocked layout, the one copy
 * of the weight that the compiled CPU path holds (compiled_engine/linear/packed_cpu.py):
 *
 *   y[r, o] = sum_i x[r, i] * w[o / B, i, o % B] + bias[o]   x [rows, in], y [rows, out]
 *
 * that is, blocks of B output rows, each stored input-major: for each input i, the B weights of
 * the block's outputs side by side. oneDNN picks B per shape and per machine (16 and 64 have been
 * seen on one CPU model), so B is an argument: any multiple of 8 up to MAX_BLOCK. A pass over a
 * block reads it front to back and keeps B / 8 vectors of sums per row of x: each input's weights
 * meet the broadcast x[r, i] in one multiply-add per vector, so every weight is read once for up
 * to MAX_ROWS rows. Blocks are split across threads (OpenMP).
 *
 * Vectors are GCC/Clang vector extensions of 8 floats. Returns 0, or a nonzero status for
 * shapes it does not take.
 */
#include <stdint.h>

#define LANES 8
#define MAX_BLOCK 64
#define MAX_VECS (MAX_BLOCK / LANES) /* vectors of sums per row, at most */
#define MAX_ROWS 4

typedef float vec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4)));

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }

static inline void store(float *p, vec v) { *(vec_u *)p = v; }

/* One block of B = 8 V outputs for R rows of x: y[r, o] for the block's outputs o, the block's
 * bias added (when there is one). Always inlined into passes with constant R and V, so that every
 * loop is unrolled and the sums stay in registers (a local array: sums in memory that could alias
 * x would cost a store per multiply-add). */
static inline __attribute__((always_inline)) void block_pass(const float *x, int64_t in, const float *w,
                                                             const float *bias, float *y, int64_t out, int R,
                                                             int V) {
    vec acc[MAX_ROWS][MAX_VECS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = bias ? load(bias + v * LANES) : splat(0.0f);
    for (int64_t i = 0; i < in; i++) {
        const float *wi = w + i * V * LANES;
        vec wv[MAX_VECS];
        for (int v = 0; v < V; v++) wv[v] = load(wi + v * LANES);
        for (int r = 0; r < R; r++) {
            const vec xr = splat(x[r * in + i]);
            for (int v = 0; v < V; v++) acc[r][v] += xr * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) store(y + r * out + v * LANES, acc[r][v]);
}

typedef void (*pass_fn)(const float *x, int64_t in, const float *w, const float *bias, float *y, int64_t out);

#define PASS(R, V)                                                                                     \
    static void pass_##R##_##V(const float *x, int64_t in, const float *w, const float *bias, float *y, \
                               int64_t out) {                                                          \
        block_pass(x, in, w, bias, y, out, R, V);                                                      \
    }
#define PASSES(R) PASS(R, 1) PASS(R, 2) PASS(R, 3) PASS(R, 4) PASS(R, 5) PASS(R, 6) PASS(R, 7) PASS(R, 8)
PASSES(1)
PASSES(2)
PASSES(3)
PASSES(4)
#define ROW(R) {pass_##R##_1, pass_##R##_2, pass_##R##_3, pass_##R##_4, pass_##R##_5, pass_##R##_6, pass_##R##_7, pass_##R##_8}
static const pass_fn PASS_TABLE[MAX_ROWS][MAX_VECS] = {ROW(1), ROW(2), ROW(3), ROW(4)};

int blocked_gemv_max_block(void) { return MAX_BLOCK; }
int blocked_gemv_lanes(void) { return LANES; }
int blocked_gemv_max_rows(void) { return MAX_ROWS; }

int blocked_gemv_f32(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, int64_t block,
                     const float *bias, float *y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || in < 1) return 1;
    if (block < LANES || block > MAX_BLOCK || block % LANES != 0) return 2;
    if (out < block || out % block != 0) return 3;
    const pass_fn pass = PASS_TABLE[rows - 1][block / LANES - 1];
    const int64_t blocks = out / block;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        pass(x, in, w + b * in * block, bias ? bias + b * block : 0, y + b * block, out);
    return 0;
}
