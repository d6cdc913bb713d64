/* Products of a few fp32 rows with an fp32 weight kept in oneDNN's blocked layout, the one copy
 * of the weight that the compiled CPU path holds (compiled_engine/model/packed_linear.py):
 *
 *   y[r, o] = sum_i x[r, i] * w[o / BLOCK, i, o % BLOCK] + bias[o]   x [rows, in], y [rows, out]
 *
 * that is, blocks of BLOCK output rows, each stored input-major: for each input i, the BLOCK
 * weights of the block's outputs side by side. A pass over a block reads it front to back and
 * keeps BLOCK / 8 vectors of sums per row of x: each input's weights meet the broadcast x[r, i]
 * in one multiply-add per vector, so every weight is read once for up to MAX_ROWS rows. Blocks
 * are split across threads (OpenMP).
 *
 * Vectors are GCC/Clang vector extensions of 8 floats. Returns 0, or a nonzero status for
 * shapes it does not take.
 */
#include <stdint.h>

#define LANES 8
#define BLOCK 64
#define VECS (BLOCK / LANES) /* vectors of sums per row */
#define MAX_ROWS 4

typedef float vec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4)));

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }

/* One block's sums for R rows of x: sums[r][v] holds outputs v * 8 .. v * 8 + 7 of the block. */
#define BLOCK_PASS(R)                                                                             \
    static void block_pass_##R(const float *x, int64_t in, const float *w, vec sums[MAX_ROWS][VECS]) { \
        for (int r = 0; r < R; r++)                                                               \
            for (int v = 0; v < VECS; v++) sums[r][v] = splat(0.0f);                              \
        for (int64_t i = 0; i < in; i++) {                                                        \
            const float *wi = w + i * BLOCK;                                                      \
            vec wv[VECS];                                                                         \
            for (int v = 0; v < VECS; v++) wv[v] = load(wi + v * LANES);                          \
            for (int r = 0; r < R; r++) {                                                         \
                const vec xr = splat(x[r * in + i]);                                              \
                for (int v = 0; v < VECS; v++) sums[r][v] += xr * wv[v];                          \
            }                                                                                     \
        }                                                                                         \
    }
BLOCK_PASS(1)
BLOCK_PASS(2)
BLOCK_PASS(3)
BLOCK_PASS(4)

int blocked_gemv_block(void) { return BLOCK; }
int blocked_gemv_max_rows(void) { return MAX_ROWS; }

int blocked_gemv_f32(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, const float *bias,
                     float *y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || in < 1 || out < BLOCK || out % BLOCK != 0) return 1;
    const int64_t blocks = out / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        vec sums[MAX_ROWS][VECS];
        const float *wb = w + b * in * BLOCK;
        switch (rows) {
            case 1: block_pass_1(x, in, wb, sums); break;
            case 2: block_pass_2(x, in, wb, sums); break;
            case 3: block_pass_3(x, in, wb, sums); break;
            default: block_pass_4(x, in, wb, sums); break;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int v = 0; v < VECS; v++)
                for (int l = 0; l < LANES; l++) {
                    const int64_t o = b * BLOCK + v * LANES + l;
                    y[r * out + o] = sums[r][v][l] + (bias ? bias[o] : 0.0f);
                }
    }
    return 0;
}
