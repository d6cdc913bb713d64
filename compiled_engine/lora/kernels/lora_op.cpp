// The CPU kernel of compiled_engine::lora_delta (lora/layers.py defines its schema and the slot
// layout), so that a compiled graph calls it with no Python between: at every product of every
// layer, Python's dispatch cost more than the product itself (docs/benchmarks.md).
//
// x [tokens, in]; a [slots, pieces * rank, in]; b [slots, rank, out] (B transposed), where output
// column o of piece p takes piece p's rank rows of a x only; token_slots[t]: token t's slot, -1
// for none; widths: the output columns of each piece.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

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

// sum_i p[i] * q[i], in eight partial sums so that the loop pipelines (and vectorizes).
float dot(const float *p, const float *q, int64_t n) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) part[j] += p[i + j] * q[i + j];
    float total = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < n; i++) total += p[i] * q[i];
    return total;
}

// Few tokens on a slot (decode): both products as plain loops, split over the threads (A by its
// rows, B by output columns). At this size at::mm's dispatch and copies cost several times the
// arithmetic. B's loop runs along its rows, y[o] += h[k] * bt[k][o], which vectorizes with no
// horizontal sums.
constexpr int64_t FEW_TOKENS = 4;
constexpr int64_t GRAIN = 256;  // output columns a thread takes at least

void few_tokens_delta(const float *x, const std::vector<int64_t> &rows, int64_t in, const float *a_slot,
                      const float *bt_slot, int64_t rank, const std::vector<int64_t> &widths, float *y, int64_t out) {
    const int64_t pieces = static_cast<int64_t>(widths.size());
    std::vector<int64_t> starts(pieces + 1, 0);
    for (int64_t p = 0; p < pieces; p++) starts[p + 1] = starts[p] + widths[p];
    std::vector<float> hidden(pieces * rank);
    for (const int64_t r : rows) {
        const float *xr = x + r * in;
        [&](int64_t begin, int64_t end) {
            for (int64_t k = begin; k < end; k++) hidden[k] = dot(a_slot + k * in, xr, in);
        }(0, pieces * rank);
        float *yr = y + r * out;
        [&](int64_t begin, int64_t end) {
            for (int64_t p = 0; p < pieces; p++) {
                const int64_t lo = std::max(begin, starts[p]), hi = std::min(end, starts[p + 1]);
                for (int64_t k = 0; k < rank && lo < hi; k++) {
                    const float h = hidden[p * rank + k];
                    const float *column = bt_slot + k * out;
                    for (int64_t o = lo; o < hi; o++) yr[o] += h * column[o];
                }
            }
        }(0, out);
    }
}

// Many tokens: at::mm per piece, on the slot's tokens (a narrow of x, or one gather).
void many_tokens_delta(const at::Tensor &x, const SlotTokens &group, const at::Tensor &a, const at::Tensor &b,
                       int64_t rank, const std::vector<int64_t> &widths, at::Tensor &out) {
    const bool contiguous = group.runs.size() == 1;
    at::Tensor index, rows;
    if (contiguous) {
        rows = x.narrow(0, group.runs[0].first, group.count);
    } else {
        std::vector<int64_t> tokens;
        for (const auto &[start, end] : group.runs)
            for (int64_t t = start; t < end; t++) tokens.push_back(t);
        index = at::tensor(tokens, at::kLong);
        rows = x.index_select(0, index);
    }
    const at::Tensor hidden = at::mm(rows, a.select(0, group.slot).t());
    at::Tensor result = contiguous ? out.narrow(0, group.runs[0].first, group.count)
                                   : at::empty({group.count, out.size(1)}, out.options());
    int64_t row = 0;
    for (size_t p = 0; p < widths.size(); p++) {
        at::Tensor target = result.narrow(1, row, widths[p]);
        at::mm_out(target, hidden.narrow(1, static_cast<int64_t>(p) * rank, rank),
                   b.select(0, group.slot).narrow(1, row, widths[p]));
        row += widths[p];
    }
    if (!contiguous) out.index_copy_(0, index, result);
}

at::Tensor lora_delta(const at::Tensor &x, const at::Tensor &a, const at::Tensor &b, const at::Tensor &token_slots,
                      at::IntArrayRef widths_ref) {
    const std::vector<int64_t> widths(widths_ref.begin(), widths_ref.end());
    int64_t out_rows = 0;
    for (const int64_t w : widths) out_rows += w;
    const int64_t tokens = x.size(0);
    TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == x.size(1) &&
                    a.size(1) == static_cast<int64_t>(widths.size()) * b.size(1) && b.size(2) == out_rows,
                "lora_delta: x [tokens, in], a [slots, pieces * rank, in], b [slots, rank, out] and the pieces' "
                "widths do not fit");
    TORCH_CHECK(token_slots.dim() == 1 && token_slots.scalar_type() == at::kLong && token_slots.is_cpu() &&
                    token_slots.size(0) >= tokens,
                "lora_delta: token_slots must be int64 on the CPU with a slot for each of the ", tokens, " tokens");
    at::Tensor out = at::zeros({tokens, out_rows}, x.options());
    const at::Tensor slots = token_slots.narrow(0, 0, tokens).contiguous();
    const std::vector<SlotTokens> groups = group_by_slot(slots.data_ptr<int64_t>(), tokens, a.size(0));
    if (groups.empty()) return out;
    const int64_t rank = b.size(1);
    const bool plain = x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                       b.scalar_type() == at::kFloat && x.is_contiguous() && a.is_contiguous() && b.is_contiguous();
    for (const SlotTokens &group : groups) {
        if (plain && group.count <= FEW_TOKENS) {
            std::vector<int64_t> rows;
            for (const auto &[start, end] : group.runs)
                for (int64_t t = start; t < end; t++) rows.push_back(t);
            const int64_t in = x.size(1);
            few_tokens_delta(x.data_ptr<float>(), rows, in, a.data_ptr<float>() + group.slot * a.size(1) * in,
                             b.data_ptr<float>() + group.slot * rank * out_rows, rank, widths, out.data_ptr<float>(),
                             out_rows);
        } else {
            many_tokens_delta(x, group, a, b, rank, widths, out);
        }
    }
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) { m.impl("lora_delta", lora_delta); }
