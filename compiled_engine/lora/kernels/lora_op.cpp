// The CPU kernel of compiled_engine::lora_delta (lora/layers.py defines its schema), so that a
// compiled graph calls it with no Python between: at every product of every layer, Python's
// dispatch cost more than the product itself (docs/benchmarks.md). The runner hands it each
// forward's runs of tokens once, through compiled_engine_lora::set_plan.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

// One forward's tokens by adapter slot: each slot's token rows, as one run [start, end) when they
// are contiguous, else as an index for one gather and one scatter, so that each slot costs two
// products whatever the order of the batch.
struct SlotRows {
    int64_t slot;
    int64_t start, end;  // the single run, when `index` is undefined
    at::Tensor index;    // int64 rows, when the slot's tokens are not contiguous
    int64_t max_row;
};

std::vector<SlotRows> current_plan;

void set_plan(const at::Tensor &runs) {
    TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.scalar_type() == at::kLong && runs.is_cpu(),
                "compiled_engine_lora::set_plan: runs must be int64 [n, 3] on the CPU");
    const at::Tensor contiguous = runs.contiguous();
    const int64_t *p = contiguous.data_ptr<int64_t>();
    std::vector<std::pair<int64_t, std::vector<std::pair<int64_t, int64_t>>>> by_slot;
    for (int64_t i = 0; i < contiguous.size(0); i++) {
        const int64_t start = p[3 * i], end = p[3 * i + 1], slot = p[3 * i + 2];
        TORCH_CHECK(0 <= start && start < end && slot >= 0, "compiled_engine_lora::set_plan: run ", i,
                    " [", start, ", ", end, ") on slot ", slot, " is not a run of tokens");
        auto found = std::find_if(by_slot.begin(), by_slot.end(), [&](const auto &e) { return e.first == slot; });
        if (found == by_slot.end()) {
            by_slot.push_back({slot, {}});
            found = by_slot.end() - 1;
        }
        found->second.push_back({start, end});
    }
    current_plan.clear();
    for (const auto &[slot, runs_of_slot] : by_slot) {
        SlotRows rows{slot, runs_of_slot[0].first, runs_of_slot[0].second, at::Tensor(), 0};
        for (const auto &run : runs_of_slot) rows.max_row = std::max(rows.max_row, run.second);
        if (runs_of_slot.size() > 1) {
            std::vector<int64_t> index;
            for (const auto &[start, end] : runs_of_slot)
                for (int64_t t = start; t < end; t++) index.push_back(t);
            rows.index = at::tensor(index, at::kLong);
        }
        current_plan.push_back(rows);
    }
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

// A few contiguous rows (decode): both products as plain loops on this thread. At this size
// at::mm's dispatch and threads cost several times the arithmetic.
constexpr int64_t FEW_ROWS = 4;

void few_rows_delta(const float *x, int64_t rows, int64_t in, const float *a, const float *b, int64_t rank,
                    int64_t out, float *y) {
    std::vector<float> hidden(rank);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < rank; k++) hidden[k] = dot(a + k * in, x + r * in, in);
        for (int64_t o = 0; o < out; o++) y[r * out + o] = dot(b + o * rank, hidden.data(), rank);
    }
}

at::Tensor lora_delta(const at::Tensor &x, const at::Tensor &a, const at::Tensor &b) {
    TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == x.size(1) &&
                    b.size(2) == a.size(1),
                "lora_delta: x [tokens, in], a [slots, rank, in] and b [slots, out, rank] do not fit");
    at::Tensor out = at::zeros({x.size(0), b.size(1)}, x.options());
    for (const SlotRows &rows : current_plan) {
        TORCH_CHECK(rows.max_row <= x.size(0) && rows.slot < a.size(0), "lora_delta: tokens up to ", rows.max_row,
                    " on slot ", rows.slot, " are outside this product's ", x.size(0), " tokens or ", a.size(0),
                    " slots");
        const at::Tensor a_slot = a.select(0, rows.slot).t(), b_slot = b.select(0, rows.slot).t();
        const bool plain = x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                           b.scalar_type() == at::kFloat && x.is_contiguous() && a.is_contiguous() && b.is_contiguous();
        if (!rows.index.defined() && plain && rows.end - rows.start <= FEW_ROWS) {
            const int64_t in = x.size(1), rank = a.size(1), width = b.size(1);
            few_rows_delta(x.data_ptr<float>() + rows.start * in, rows.end - rows.start, in,
                           a.data_ptr<float>() + rows.slot * rank * in, b.data_ptr<float>() + rows.slot * width * rank,
                           rank, width, out.data_ptr<float>() + rows.start * width);
        } else if (!rows.index.defined()) {
            at::Tensor target = out.narrow(0, rows.start, rows.end - rows.start);
            at::mm_out(target, at::mm(x.narrow(0, rows.start, rows.end - rows.start), a_slot), b_slot);
        } else {
            out.index_copy_(0, rows.index, at::mm(at::mm(x.index_select(0, rows.index), a_slot), b_slot));
        }
    }
    return out;
}

}  // namespace

TORCH_LIBRARY(compiled_engine_lora, m) { m.def("set_plan(Tensor runs) -> ()", set_plan); }

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) { m.impl("lora_delta", lora_delta); }
