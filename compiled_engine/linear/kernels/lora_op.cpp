// The CPU kernel of compiled_engine::lora_delta (linear/lora_op.py defines its schema and the slot
// layout), so that a compiled graph calls it with no Python between: at every product of every
// layer, Python's dispatch cost more than the product itself (docs/benchmarks.md).
//
// x [tokens, in]; a [slots, pieces * rank, in]; b [slots, rank, out] (B transposed), where output
// column o of piece p takes piece p's rank rows of a x only; token_slots[t]: token t's slot, -1
// for none; widths: the output columns of each piece.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#else  // one thread
inline int omp_get_num_threads() { return 1; }
inline int omp_get_thread_num() { return 0; }
#endif

// The quantized products' strips (linear/kernels/quant_matmul.c, linked into this library),
// so that a product and its delta share one parallel region.
extern "C" {
void int4_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const uint8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last);
void int8_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const int8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last);
int64_t quant_strips(int64_t out);
int64_t quant_strip_rows(void);
int int4_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group);
int int8_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group);
void quant_group_sums_f32(const float *x, int64_t rows, int64_t in, int64_t group, float *sums);
}

namespace {

// One slot's tokens in this forward: its runs [start, end) of neighbouring tokens.
struct SlotTokens {
    int64_t slot;
    std::vector<std::pair<int64_t, int64_t>> runs;
    int64_t count = 0;
};

std::vector<SlotTokens> group_by_slot(const int64_t *slots, int64_t tokens, int64_t num_slots) {
    std::vector<SlotTokens> groups;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        TORCH_CHECK(slot < num_slots, "lora_delta: token ", t, " uses slot ", slot, " of ", num_slots);
        auto found = std::find_if(groups.begin(), groups.end(), [&](const SlotTokens &g) { return g.slot == slot; });
        if (found == groups.end()) {
            groups.push_back({slot, {}, 0});
            found = groups.end() - 1;
        }
        if (!found->runs.empty() && found->runs.back().second == t)
            found->runs.back().second = t + 1;
        else
            found->runs.push_back({t, t + 1});
        found->count++;
    }
    return groups;
}

// The group's tokens, in order.
std::vector<int64_t> tokens_of(const SlotTokens &group) {
    std::vector<int64_t> tokens;
    tokens.reserve(group.count);
    for (const auto &[start, end] : group.runs)
        for (int64_t t = start; t < end; t++) tokens.push_back(t);
    return tokens;
}

// Where each piece's output columns start, and their end: starts[p] .. starts[p + 1].
std::vector<int64_t> piece_starts(const std::vector<int64_t> &widths) {
    std::vector<int64_t> starts(widths.size() + 1, 0);
    for (size_t p = 0; p < widths.size(); p++) starts[p + 1] = starts[p] + widths[p];
    return starts;
}

typedef float vec __attribute__((vector_size(32)));
typedef float vec_u __attribute__((vector_size(32), aligned(4)));
inline vec load(const float *p) { return *(const vec_u *)p; }
inline void store(float *p, vec v) { *(vec_u *)p = v; }
inline vec splat(float v) { return (vec){v, v, v, v, v, v, v, v}; }
inline float hsum(vec v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// sum_i p[i] * q[i] in four independent vector sums, so that the multiply-adds pipeline.
float dot(const float *p, const float *q, int64_t n) {
    vec s0 = splat(0), s1 = splat(0), s2 = splat(0), s3 = splat(0);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 += load(p + i) * load(q + i);
        s1 += load(p + i + 8) * load(q + i + 8);
        s2 += load(p + i + 16) * load(q + i + 16);
        s3 += load(p + i + 24) * load(q + i + 24);
    }
    for (; i + 8 <= n; i += 8) s0 += load(p + i) * load(q + i);
    float total = hsum((s0 + s1) + (s2 + s3));
    for (; i < n; i++) total += p[i] * q[i];
    return total;
}

// y[lo, hi) += h . bt[:, lo, hi): the rank rows of B (transposed) weighted by the hidden values,
// sixteen output columns at a time held in registers across the rank.
void add_columns(const float *h, const float *bt, int64_t rank, int64_t out, int64_t lo, int64_t hi, float *y) {
    int64_t o = lo;
    for (; o + 16 <= hi; o += 16) {
        vec c0 = load(y + o), c1 = load(y + o + 8);
        for (int64_t k = 0; k < rank; k++) {
            const vec hk = splat(h[k]);
            c0 += hk * load(bt + k * out + o);
            c1 += hk * load(bt + k * out + o + 8);
        }
        store(y + o, c0);
        store(y + o + 8, c1);
    }
    for (; o < hi; o++) {
        float c = y[o];
        for (int64_t k = 0; k < rank; k++) c += h[k] * bt[k * out + o];
        y[o] = c;
    }
}

// Tokens on slots with at most FEW_TOKENS tokens each (decode batches): both products as loops
// over the rows, in one parallel region: the threads split A's rows, meet, then split the output
// columns. A slot's tokens are neighbours in `rows`, so its A and B stay in cache between them.
// At this size at::mm's calls cost more than the arithmetic (a batch of 32 decodes over 4
// adapters paid about 1 ms a product, docs/benchmarks.md), and the region's one fork and one
// barrier cost less than the second core brings (one token's loops are bound by reading A and B).
constexpr int64_t FEW_TOKENS = 32;

void few_tokens_delta(const float *x, const std::vector<std::pair<int64_t, int64_t>> &rows, int64_t in,
                      const float *a, const float *bt, int64_t rank, const std::vector<int64_t> &widths, float *y,
                      int64_t out) {
    const int64_t pieces = static_cast<int64_t>(widths.size()), piece_ranks = pieces * rank;
    const int64_t count = static_cast<int64_t>(rows.size());
    const std::vector<int64_t> starts = piece_starts(widths);
    std::vector<float> hidden(count * piece_ranks);
    const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, out / 64)));
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t k0 = piece_ranks * me / team, k1 = piece_ranks * (me + 1) / team;
        for (int64_t r = 0; r < count; r++) {
            const float *a_slot = a + rows[r].second * piece_ranks * in, *xr = x + rows[r].first * in;
            for (int64_t k = k0; k < k1; k++) hidden[r * piece_ranks + k] = dot(a_slot + k * in, xr, in);
        }
#pragma omp barrier
        const int64_t blocks = (out + 15) / 16;  // columns split in whole vectors
        const int64_t o0 = std::min(out, blocks * me / team * 16), o1 = std::min(out, blocks * (me + 1) / team * 16);
        for (int64_t r = 0; r < count; r++) {
            const float *bt_slot = bt + rows[r].second * rank * out;
            for (int64_t p = 0; p < pieces; p++) {
                const int64_t lo = std::max(o0, starts[p]), hi = std::min(o1, starts[p + 1]);
                if (lo < hi)
                    add_columns(hidden.data() + r * piece_ranks + p * rank, bt_slot, rank, out, lo, hi,
                                y + rows[r].first * out);
            }
        }
    }
}

// Many tokens: at::addmm per piece, on the slot's tokens (a narrow of x, or one gather and one
// scatter-add).
void many_tokens_delta(const at::Tensor &x, const SlotTokens &group, const at::Tensor &a, const at::Tensor &b,
                       int64_t rank, const std::vector<int64_t> &widths, at::Tensor &out) {
    const bool contiguous = group.runs.size() == 1;
    at::Tensor index, rows;
    if (contiguous) {
        rows = x.narrow(0, group.runs[0].first, group.count);
    } else {
        index = at::tensor(tokens_of(group), at::kLong);
        rows = x.index_select(0, index);
    }
    const at::Tensor hidden = at::mm(rows, a.select(0, group.slot).t());
    at::Tensor result = contiguous ? out.narrow(0, group.runs[0].first, group.count)
                                   : at::zeros({group.count, out.size(1)}, out.options());
    int64_t row = 0;
    for (size_t p = 0; p < widths.size(); p++) {
        result.narrow(1, row, widths[p])
            .addmm_(hidden.narrow(1, static_cast<int64_t>(p) * rank, rank),
                    b.select(0, group.slot).narrow(1, row, widths[p]));
        row += widths[p];
    }
    if (!contiguous) out.index_add_(0, index, result);
}

// out [tokens, out] += each token's delta (the operators below differ only in what out holds first).
void add_lora_delta(at::Tensor &out, const at::Tensor &x, const at::Tensor &a, const at::Tensor &b,
                    const at::Tensor &token_slots, const std::vector<int64_t> &widths) {
    int64_t out_rows = 0;
    for (const int64_t w : widths) out_rows += w;
    const int64_t tokens = x.size(0);
    TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == x.size(1) &&
                    a.size(1) == static_cast<int64_t>(widths.size()) * b.size(1) && b.size(2) == out_rows &&
                    out.size(0) == tokens && out.size(1) == out_rows,
                "lora_delta: x [tokens, in], a [slots, pieces * rank, in], b [slots, rank, out] and the pieces' "
                "widths do not fit");
    TORCH_CHECK(token_slots.dim() == 1 && token_slots.scalar_type() == at::kLong && token_slots.is_cpu() &&
                    token_slots.is_contiguous() && token_slots.size(0) >= tokens,
                "lora_delta: token_slots must be int64 on the CPU with a slot for each of the ", tokens, " tokens");
    const std::vector<SlotTokens> groups = group_by_slot(token_slots.data_ptr<int64_t>(), tokens, a.size(0));
    if (groups.empty()) return;
    const int64_t rank = b.size(1);
    const bool plain = x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                       b.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.is_contiguous() &&
                       a.is_contiguous() && b.is_contiguous() && out.is_contiguous();
    std::vector<std::pair<int64_t, int64_t>> few;  // (token, slot) of the slots with few tokens
    for (const SlotTokens &group : groups) {
        if (plain && group.count <= FEW_TOKENS) {
            for (const int64_t t : tokens_of(group)) few.push_back({t, group.slot});
        } else {
            many_tokens_delta(x, group, a, b, rank, widths, out);
        }
    }
    if (!few.empty())
        few_tokens_delta(x.data_ptr<float>(), few, x.size(1), a.data_ptr<float>(), b.data_ptr<float>(), rank, widths,
                         out.data_ptr<float>(), out_rows);
}

at::Tensor lora_delta(const at::Tensor &x, const at::Tensor &a, const at::Tensor &b, const at::Tensor &token_slots,
                      at::IntArrayRef widths) {
    int64_t out_rows = 0;
    for (const int64_t w : widths) out_rows += w;
    at::Tensor out = at::zeros({x.size(0), out_rows}, x.options());
    add_lora_delta(out, x, a, b, token_slots, std::vector<int64_t>(widths.begin(), widths.end()));
    return out;
}

// partial[lo, hi) += sum_j h[j] * rows[j][lo, hi) over four rows of B (transposed) at once, so
// that the partial output is loaded and stored once for four of them.
void add_four_rows(float *partial, const float *h, const float *const rows[4], int64_t lo, int64_t hi) {
    const vec h0 = splat(h[0]), h1 = splat(h[1]), h2 = splat(h[2]), h3 = splat(h[3]);
    int64_t o = lo;
    for (; o + 8 <= hi; o += 8)
        store(partial + o, load(partial + o) + ((h0 * load(rows[0] + o) + h1 * load(rows[1] + o)) +
                                                (h2 * load(rows[2] + o) + h3 * load(rows[3] + o))));
    for (; o < hi; o++)
        partial[o] += (h[0] * rows[0][o] + h[1] * rows[1][o]) + (h[2] * rows[2][o] + h[3] * rows[3][o]);
}

void add_row(float *partial, float h, const float *row, int64_t lo, int64_t hi) {
    const vec hv = splat(h);
    int64_t o = lo;
    for (; o + 8 <= hi; o += 8) store(partial + o, load(partial + o) + hv * load(row + o));
    for (; o < hi; o++) partial[o] += h * row[o];
}

// The rank rows [k0, k1) of one slot's adapter for its tokens `tokens`, added into `partial`
// [tokens of x, out]: A's rows of every piece against x (each row read once, for every token),
// then the same rows of B, each read front to back.
void slot_rank_rows(const float *x, int64_t in, const std::vector<int64_t> &tokens, const float *a, const float *bt,
                    int64_t rank, const std::vector<int64_t> &starts, int64_t k0, int64_t k1, int64_t out,
                    float *hidden, float *partial) {
    const int64_t pieces = static_cast<int64_t>(starts.size()) - 1, count = k1 - k0;
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (int64_t p = 0; p < pieces; p++)
        for (int64_t k = k0; k < k1; k++) {
            const float *row = a + (p * rank + k) * in;
            for (int64_t t = 0; t < n; t++) hidden[(t * pieces + p) * count + (k - k0)] = dot(row, x + tokens[t] * in, in);
        }
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
        const float *const rows[4] = {bt + k * out, bt + (k + 1) * out, bt + (k + 2) * out, bt + (k + 3) * out};
        for (int64_t t = 0; t < n; t++)
            for (int64_t p = 0; p < pieces; p++)
                add_four_rows(partial + tokens[t] * out, hidden + (t * pieces + p) * count + (k - k0), rows, starts[p],
                              starts[p + 1]);
    }
    for (; k < k1; k++)
        for (int64_t t = 0; t < n; t++)
            for (int64_t p = 0; p < pieces; p++)
                add_row(partial + tokens[t] * out, hidden[(t * pieces + p) * count + (k - k0)], bt + k * out, starts[p],
                        starts[p + 1]);
}

// The quantized product of a decode-sized batch and its adapters' delta in one parallel region,
// with one barrier: each thread computes its share of the product's strips and its share of every
// slot's rank rows, into a partial output of its own (so the threads read A and B as contiguous
// runs and never wait on each other between the product and the delta); after the barrier each
// thread adds the partials into the strips it computed. Two regions (product, then delta) cost a
// fork, a join and a barrier more per product (docs/benchmarks.md). False: not this path's shapes.
bool fused_few_tokens(const at::Tensor &x, const at::Tensor &data, const at::Tensor &scales,
                      const std::optional<at::Tensor> &offsets, const std::optional<at::Tensor> &bias,
                      int64_t group_size, const float *a, const float *bt, int64_t slots, int64_t rank,
                      const std::vector<int64_t> &widths, const at::Tensor &token_slots, at::Tensor &y) {
    const bool int4 = data.scalar_type() == at::kByte;
    const int64_t rows = x.size(0), in = x.size(1), out = data.size(0);
    if (int4 ? int4_shape_status(rows, in, out, group_size) : int8_shape_status(rows, in, out, group_size))
        return false;
    const std::vector<SlotTokens> groups = group_by_slot(token_slots.data_ptr<int64_t>(), rows, slots);
    std::vector<std::vector<int64_t>> group_tokens;
    for (const SlotTokens &group : groups) group_tokens.push_back(tokens_of(group));
    const std::vector<int64_t> starts = piece_starts(widths);
    const int64_t pieces = static_cast<int64_t>(widths.size()), strips = quant_strips(out), strip = quant_strip_rows();
    const int threads = std::max(1, at::get_num_threads());
    const int64_t groups_in = in / group_size;
    // scratch: group sums (for offsets), then per thread a partial output [rows, out] and hidden values
    const int64_t sums_size = offsets ? rows * groups_in : 0, partial_size = groups.empty() ? 0 : rows * out;
    const int64_t hidden_size = rows * pieces * rank;
    thread_local std::vector<float> scratch;
    scratch.resize(sums_size + threads * (partial_size + hidden_size));
    float *sums = scratch.data(), *per_thread = scratch.data() + sums_size;
    if (offsets) quant_group_sums_f32(x.data_ptr<float>(), rows, in, group_size, sums);
    const float *xp = x.data_ptr<float>(), *bias_ptr = bias ? bias->data_ptr<float>() : nullptr;
    float *yp = y.data_ptr<float>();
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t s0 = strips * me / team, s1 = strips * (me + 1) / team;
        if (int4)
            int4_matmul_strips_f32(xp, rows, in, data.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                   offsets->data_ptr<float>(), out, group_size, bias_ptr, yp, sums, s0, s1);
        else
            int8_matmul_strips_f32(xp, rows, in, data.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                   offsets ? offsets->data_ptr<float>() : nullptr, out, group_size, bias_ptr, yp,
                                   offsets ? sums : nullptr, s0, s1);
        if (!groups.empty()) {
            float *partial = per_thread + me * (partial_size + hidden_size), *hidden = partial + partial_size;
            for (const std::vector<int64_t> &tokens : group_tokens)
                for (const int64_t t : tokens) std::fill(partial + t * out, partial + (t + 1) * out, 0.0f);
            const int64_t k0 = rank * me / team, k1 = rank * (me + 1) / team;
            for (size_t g = 0; g < groups.size() && k0 < k1; g++) {
                const int64_t slot = groups[g].slot;
                slot_rank_rows(xp, in, group_tokens[g], a + slot * pieces * rank * in, bt + slot * rank * out, rank,
                               starts, k0, k1, out, hidden, partial);
            }
#pragma omp barrier
            const int64_t o0 = std::min(out, s0 * strip), o1 = std::min(out, s1 * strip);
            for (const std::vector<int64_t> &tokens : group_tokens)
                for (const int64_t t : tokens)
                    for (int64_t m = 0; m < team; m++) {
                        const float *src = per_thread + m * (partial_size + hidden_size) + t * out;
                        if (rank * m / team < rank * (m + 1) / team) add_row(yp + t * out, 1.0f, src, o0, o1);
                    }
        }
    }
    return true;
}

// The quantized product and its adapters' delta in one call: up to 32 tokens in one parallel
// region (fused_few_tokens); more through compiled_engine::quantized_linear_f32
// (linear/kernels/quant_op.cpp, found through the dispatcher), then the delta added into its
// output. One operator call a product instead of two, and no zeroed delta and no sum to write.
// The slots come as the layer's flat stores and where this product's part starts in each
// (a [slots, pieces * rank, in] from a_start, b [slots, rank, out] from b_start), so that a
// compiled graph passes its inputs as they are: a view made in the graph's Python costs more
// than the product's delta for one token (docs/benchmarks.md).
at::Tensor quantized_lora_linear_f32(const at::Tensor &x, const at::Tensor &data, const at::Tensor &scales,
                                     const std::optional<at::Tensor> &offsets, const std::optional<at::Tensor> &bias,
                                     int64_t group_size, int64_t max_kernel_rows, int64_t gemm_max_rows,
                                     const at::Tensor &a_store,
                                     const at::Tensor &b_store, const at::Tensor &token_slots, int64_t a_start,
                                     int64_t b_start, int64_t slots, int64_t rank, at::IntArrayRef widths) {
    const int64_t in = x.size(1), pieces = static_cast<int64_t>(widths.size()), out = data.size(0);
    TORCH_CHECK(a_store.dim() == 1 && b_store.dim() == 1 && a_store.is_contiguous() && b_store.is_contiguous() &&
                    a_start >= 0 && b_start >= 0 && slots > 0 && rank > 0 &&
                    a_start + slots * pieces * rank * in <= a_store.numel() &&
                    b_start + slots * rank * out <= b_store.numel(),
                "quantized_lora_linear_f32: the slots [", slots, ", ", pieces, " x ", rank, ", ", in, "] from ",
                a_start, " and [", slots, ", ", rank, ", ", out, "] from ", b_start, " do not fit the stores");
    const std::vector<int64_t> piece_widths(widths.begin(), widths.end());
    int64_t width_sum = 0;
    for (const int64_t w : piece_widths) width_sum += w;
    const bool int4 = data.scalar_type() == at::kByte;
    const auto plain_f32 = [](const at::Tensor &t) { return t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu(); };
    if (x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= std::min(max_kernel_rows, FEW_TOKENS) && plain_f32(x) &&
        x.size(1) == data.size(1) * (int4 ? 2 : 1) && data.is_contiguous() &&
        (int4 ? offsets.has_value() : data.scalar_type() == at::kChar) && plain_f32(scales) &&
        (!offsets || plain_f32(*offsets)) &&
        (!bias || (plain_f32(*bias) && bias->numel() == out)) && plain_f32(a_store) && plain_f32(b_store) &&
        width_sum == out && token_slots.dim() == 1 && token_slots.scalar_type() == at::kLong &&
        token_slots.is_cpu() && token_slots.is_contiguous() && token_slots.size(0) >= x.size(0)) {
        at::Tensor y = at::empty({x.size(0), out}, x.options());
        if (fused_few_tokens(x, data, scales, offsets, bias, group_size, a_store.data_ptr<float>() + a_start,
                             b_store.data_ptr<float>() + b_start, slots, rank, piece_widths, token_slots, y))
            return y;
    }
    static const auto quantized_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("compiled_engine::quantized_linear_f32", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                              const std::optional<at::Tensor> &, const std::optional<at::Tensor> &, int64_t, int64_t,
                              int64_t)>();
    at::Tensor y = quantized_linear.call(x, data, scales, offsets, bias, group_size, max_kernel_rows, gemm_max_rows);
    // as_strided's offset counts from the storage's start, not from the store's first element
    const at::Tensor a = a_store.as_strided({slots, pieces * rank, in}, {pieces * rank * in, in, 1},
                                            a_store.storage_offset() + a_start);
    const at::Tensor b = b_store.as_strided({slots, rank, out}, {rank * out, out, 1}, b_store.storage_offset() + b_start);
    add_lora_delta(y, x, a, b, token_slots, piece_widths);
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) {
    m.impl("lora_delta", lora_delta);
    m.impl("quantized_lora_linear_f32", quantized_lora_linear_f32);
}
