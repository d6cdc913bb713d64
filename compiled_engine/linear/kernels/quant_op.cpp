// compiled_engine::quantized_linear_f32: the quantized product as a native torch operator, so that
// a compiled graph calls the kernels of quant_matmul.c through the dispatcher alone, without the
// Python work of the ctypes path (about 30 us a call, docs/benchmarks.md). fp32 activations on the
// CPU only; linear/quantized_op.py sends everything else to the reference path.
//
// Up to max_kernel_rows rows run straight from the quantized weight; up to gemm_max_rows the
// many-row kernel dequantizes a strip at a time for all rows; more rows dequantize the whole
// weight and run the fp32 GEMM, as quantized_op.run_quantized_linear does. Where the crossovers
// lie is measured per shape (linear/crossover.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

extern "C" {
int int4_matmul_f32(const float *x, int64_t rows, int64_t in, const uint8_t *data, const float *scales,
                    const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads);
int int8_matmul_f32(const float *x, int64_t rows, int64_t in, const int8_t *data, const float *scales,
                    const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads);
int int4_dequantize_f32(const uint8_t *data, const float *scales, const float *offsets, int64_t out, int64_t in,
                        int64_t group, float *w, int threads);
int int8_dequantize_f32(const int8_t *data, const float *scales, const float *offsets, int64_t out, int64_t in,
                        int64_t group, float *w, int threads);
int quant_matmul_q8x_f32(const float *x, int64_t rows, int64_t in, const void *data, int int4, const float *scales,
                         const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads);
int quant_gemm_f32(const float *x, int64_t rows, int64_t in, const void *data, int int4, const float *scales,
                   const float *offsets, int64_t out, int64_t group, const float *bias, float *y, int threads);
void int4_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const uint8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last);
void int8_matmul_strips_f32(const float *x, int64_t rows, int64_t in, const int8_t *data, const float *scales,
                            const float *offsets, int64_t out, int64_t group, const float *bias, float *y,
                            const float *sums, int64_t first, int64_t last);
int64_t quant_strips(int64_t out);
void quant_group_sums_f32(const float *x, int64_t rows, int64_t in, int64_t group, float *sums);
int int4_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group);
int int8_shape_status(int64_t rows, int64_t in, int64_t out, int64_t group);
}

namespace {

at::Tensor product(const at::Tensor &x, const at::Tensor &data, const at::Tensor &scales,
                   const std::optional<at::Tensor> &offsets, const std::optional<at::Tensor> &bias, int64_t group_size,
                   int64_t max_kernel_rows, int64_t gemm_max_rows, bool int8_activations) {
    const char *name = int8_activations ? "quantized_linear_q8x_f32" : "quantized_linear_f32";
    // uint8 data is int4 (offsets required), int8 data the int8 format (offsets optional)
    const bool int4 = data.scalar_type() == at::kByte;
    const int64_t out = data.size(0), in = data.size(1) * (int4 ? 2 : 1);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == at::kFloat && x.is_cpu(),
                name, ": x must be float32 [rows, ", in, "] on the CPU");
    TORCH_CHECK(data.is_contiguous() && scales.is_contiguous() && (!offsets || offsets->is_contiguous()),
                name, ": the weight's tensors must be contiguous");
    TORCH_CHECK((int4 ? offsets.has_value() : data.scalar_type() == at::kChar) && scales.scalar_type() == at::kFloat &&
                    (!offsets || offsets->scalar_type() == at::kFloat),
                name, ": int4 data is uint8 with offsets, int8 data is int8 with or without offsets");
    const float *offsets_ptr = offsets ? offsets->data_ptr<float>() : nullptr;
    TORCH_CHECK(!bias || (bias->numel() == out && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
                name, ": bias must be float32 [", out, "]");
    const int64_t rows = x.size(0);
    if (rows == 0) return at::empty({0, out}, x.options());
    const at::Tensor xc = x.contiguous();
    const int threads = at::get_num_threads();
    const float *bias_ptr = bias ? bias->data_ptr<float>() : nullptr;
    int status;
    if (rows <= max_kernel_rows) {
        at::Tensor y = at::empty({rows, out}, x.options());
        if (int8_activations)
            status = quant_matmul_q8x_f32(xc.data_ptr<float>(), rows, in, data.data_ptr(), int4, scales.data_ptr<float>(),
                                          offsets_ptr, out, group_size, bias_ptr, y.data_ptr<float>(), threads);
        else if (int4)
            status = int4_matmul_f32(xc.data_ptr<float>(), rows, in, data.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                     offsets->data_ptr<float>(), out, group_size, bias_ptr, y.data_ptr<float>(),
                                     threads);
        else
            status = int8_matmul_f32(xc.data_ptr<float>(), rows, in, data.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                     offsets_ptr, out, group_size, bias_ptr, y.data_ptr<float>(), threads);
        TORCH_CHECK(status == 0, name, ": the kernel refused [", out, ", ", in, "] (status ", status, ")");
        return y;
    }
    if (rows <= gemm_max_rows) {
        at::Tensor y = at::empty({rows, out}, x.options());
        status = quant_gemm_f32(xc.data_ptr<float>(), rows, in, data.data_ptr(), int4, scales.data_ptr<float>(),
                                offsets_ptr, out, group_size, bias_ptr, y.data_ptr<float>(), threads);
        TORCH_CHECK(status == 0, name, ": the many-row kernel refused [", out, ", ", in, "] (status ", status, ")");
        return y;
    }
    at::Tensor w = at::empty({out, in}, x.options());
    if (int4)
        status = int4_dequantize_f32(data.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets->data_ptr<float>(), out,
                                     in, group_size, w.data_ptr<float>(), threads);
    else
        status = int8_dequantize_f32(data.data_ptr<int8_t>(), scales.data_ptr<float>(), offsets_ptr, out, in,
                                     group_size, w.data_ptr<float>(), threads);
    TORCH_CHECK(status == 0, name, ": dequantizing [", out, ", ", in, "] failed");
    return at::linear(xc, w, bias);
}

at::Tensor quantized_linear_f32(const at::Tensor &x, const at::Tensor &data, const at::Tensor &scales,
                                const std::optional<at::Tensor> &offsets, const std::optional<at::Tensor> &bias,
                                int64_t group_size, int64_t max_kernel_rows, int64_t gemm_max_rows) {
    return product(x, data, scales, offsets, bias, group_size, max_kernel_rows, gemm_max_rows, false);
}

// The same with x rounded to int8 in blocks of 32 for the direct kernel's rows (quant_matmul.c's
// 8-bit-activation products; lossy, opt-in). More rows than max_kernel_rows run exactly as above.
at::Tensor quantized_linear_q8x_f32(const at::Tensor &x, const at::Tensor &data, const at::Tensor &scales,
                                    const std::optional<at::Tensor> &offsets, const std::optional<at::Tensor> &bias,
                                    int64_t group_size, int64_t max_kernel_rows, int64_t gemm_max_rows) {
    TORCH_CHECK(group_size % 32 == 0, "quantized_linear_q8x_f32: groups must be whole blocks of 32, not ", group_size);
    return product(x, data, scales, offsets, bias, group_size, max_kernel_rows, gemm_max_rows, true);
}

// ---- A mixture of experts' products, grouped by expert (linear/quantized_experts.py) ----------
//
// The rows of every expert's weight are stacked in one quantized weight (expert e's `per` rows from
// e * per). The batch's (token, slot) pairs are sorted by expert; the pairs' rows of x are gathered
// in that order, so each expert's rows are contiguous. Experts with few rows (decode) run the
// direct kernel's strips, every (expert, strip) of a product in one parallel loop; experts with
// more rows run `product` (the many-row kernel, or dequantize-then-GEMM) one after the other.

struct ExpertWeight {
    const at::Tensor &data, &scales;
    const std::optional<at::Tensor> &offsets;
    int64_t group, per;  // group size; rows an expert
    bool int4() const { return data.scalar_type() == at::kByte; }
    int64_t in() const { return data.size(1) * (int4() ? 2 : 1); }
    int64_t groups() const { return in() / group; }
    // expert e's slice of the stacked weight, as views
    at::Tensor slice(const at::Tensor &t, int64_t e) const { return t.narrow(0, e * per, per); }
};

// y [pairs, w.per] = x [pairs, w.in] times each pair's expert's rows; experts[e] = (first pair, count).
void expert_products(const at::Tensor &x, const ExpertWeight &w, const std::vector<std::pair<int64_t, int64_t>> &experts,
                     int64_t max_kernel_rows, int64_t gemm_max_rows, at::Tensor &y) {
    const int64_t in = w.in(), out = w.per, groups = w.groups(), strips = quant_strips(out);
    const bool int4 = w.int4();
    TORCH_CHECK(!(int4 ? int4_shape_status(1, in, out, w.group) : int8_shape_status(1, in, out, w.group)),
                "quantized_expert_mlps_f32: the kernels do not take an expert of [", out, ", ", in, "] in groups of ",
                w.group);
    const float *xp = x.data_ptr<float>();
    float *yp = y.data_ptr<float>();
    std::vector<float> sums;
    if (w.offsets) {
        sums.resize(x.size(0) * groups);
        quant_group_sums_f32(xp, x.size(0), in, w.group, sums.data());
    }
    std::vector<std::pair<int64_t, int64_t>> work;  // (expert, strip) of the experts the direct kernel runs
    for (size_t e = 0; e < experts.size(); e++) {
        const auto [first, count] = experts[e];
        if (count == 0) continue;
        if (count <= max_kernel_rows) {
            for (int64_t s = 0; s < strips; s++) work.emplace_back(static_cast<int64_t>(e), s);
            continue;
        }
        const at::Tensor rows = x.narrow(0, first, count);
        std::optional<at::Tensor> offsets;
        if (w.offsets) offsets = w.slice(*w.offsets, e);
        y.narrow(0, first, count).copy_(product(rows, w.slice(w.data, e), w.slice(w.scales, e), offsets, std::nullopt,
                                                w.group, max_kernel_rows, gemm_max_rows, false));
    }
    const int64_t row_bytes = int4 ? in / 2 : in;
    const char *data = static_cast<const char *>(w.data.data_ptr());
    const float *scales = w.scales.data_ptr<float>(), *offsets = w.offsets ? w.offsets->data_ptr<float>() : nullptr;
    const int64_t items = static_cast<int64_t>(work.size());
    // Static: at decode every item is one strip of one row (equal work), and a shared counter's
    // cache line moving between the cores for each of hundreds of items cost a third of the call.
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
    for (int64_t i = 0; i < items; i++) {
        const auto [e, s] = work[i];
        const auto [first, count] = experts[e];
        const char *d = data + e * out * row_bytes;
        const float *sc = scales + e * out * groups, *of = offsets ? offsets + e * out * groups : nullptr;
        const float *su = offsets ? sums.data() + first * groups : nullptr;
        if (int4)
            int4_matmul_strips_f32(xp + first * in, count, in, reinterpret_cast<const uint8_t *>(d), sc, of, out,
                                   w.group, nullptr, yp + first * out, su, s, s + 1);
        else
            int8_matmul_strips_f32(xp + first * in, count, in, reinterpret_cast<const int8_t *>(d), sc, of, out,
                                   w.group, nullptr, yp + first * out, su, s, s + 1);
    }
}

at::Tensor quantized_expert_mlps_f32(const at::Tensor &x, const at::Tensor &weights, const at::Tensor &ids,
                                     const at::Tensor &gate_up_data, const at::Tensor &gate_up_scales,
                                     const std::optional<at::Tensor> &gate_up_offsets, int64_t gate_up_group,
                                     const at::Tensor &down_data, const at::Tensor &down_scales,
                                     const std::optional<at::Tensor> &down_offsets, int64_t down_group,
                                     int64_t num_experts, int64_t activation, int64_t max_kernel_rows,
                                     int64_t gemm_max_rows, const std::optional<at::Tensor> &gate_up_bias,
                                     const std::optional<at::Tensor> &down_bias) {
    const char *name = "quantized_expert_mlps_f32";
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu(), name, ": x must be float32 [tokens, hidden] on the CPU");
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, name,
                ": ids must be int64 [tokens, k]");
    TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, name,
                ": weights must be float32 [tokens, k]");
    for (const at::Tensor *t : {&gate_up_data, &gate_up_scales, &down_data, &down_scales})
        TORCH_CHECK(t->is_contiguous(), name, ": the experts' tensors must be contiguous");
    TORCH_CHECK(gate_up_data.size(0) % num_experts == 0 && down_data.size(0) % num_experts == 0, name,
                ": the stacked weights are not ", num_experts, " experts' rows each");
    const ExpertWeight gate_up{gate_up_data, gate_up_scales, gate_up_offsets, gate_up_group,
                               gate_up_data.size(0) / num_experts};
    const ExpertWeight down{down_data, down_scales, down_offsets, down_group, down_data.size(0) / num_experts};
    const int64_t tokens = x.size(0), k = ids.size(1), pairs = tokens * k, hidden = down.per, inter = gate_up.per / 2;
    TORCH_CHECK(gate_up.in() == x.size(1) && down.in() == inter && hidden == x.size(1), name,
                ": experts of gate/up [", gate_up.per, ", ", gate_up.in(), "] and down [", down.per, ", ", down.in(),
                "] do not fit x [", tokens, ", ", x.size(1), "]");
    TORCH_CHECK(activation >= 0 && activation <= 2, name, ": activation ", activation, " is not silu (0), gelu_tanh (1) or gpt-oss's clamped SwiGLU (2)");
    TORCH_CHECK(!gate_up_bias || (gate_up_bias->scalar_type() == at::kFloat && gate_up_bias->is_contiguous() &&
                                  gate_up_bias->numel() == num_experts * gate_up.per),
                name, ": gate_up_bias must be float32 [", num_experts, ", ", gate_up.per, "]");
    TORCH_CHECK(!down_bias || (down_bias->scalar_type() == at::kFloat && down_bias->is_contiguous() &&
                               down_bias->numel() == num_experts * hidden),
                name, ": down_bias must be float32 [", num_experts, ", ", hidden, "]");
    at::Tensor y = at::zeros({tokens, hidden}, x.options());
    if (tokens == 0) return y;
    // the pairs sorted by expert (a counting sort: stable, so each expert's pairs keep token order)
    const at::Tensor idc = ids.contiguous(), wc = weights.contiguous(), xc = x.contiguous();
    const int64_t *id = idc.data_ptr<int64_t>();
    std::vector<std::pair<int64_t, int64_t>> experts(num_experts, {0, 0});
    for (int64_t p = 0; p < pairs; p++) {
        TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, name, ": expert ", id[p], " of ", num_experts);
        experts[id[p]].second++;
    }
    for (int64_t e = 0, first = 0; e < num_experts; first += experts[e].second, e++) experts[e].first = first;
    std::vector<int64_t> order(pairs), next(num_experts);
    for (int64_t e = 0; e < num_experts; e++) next[e] = experts[e].first;
    for (int64_t p = 0; p < pairs; p++) order[next[id[p]]++] = p;
    at::Tensor rows = at::empty({pairs, x.size(1)}, x.options());
    const float *xp = xc.data_ptr<float>();
    float *rp = rows.data_ptr<float>();
    for (int64_t i = 0; i < pairs; i++) std::copy(xp + order[i] / k * hidden, xp + (order[i] / k + 1) * hidden, rp + i * hidden);
    // each sorted pair's expert (for its biases)
    std::vector<int64_t> expert_of(pairs);
    for (int64_t e = 0; e < num_experts; e++)
        std::fill(expert_of.begin() + experts[e].first, expert_of.begin() + experts[e].first + experts[e].second, e);
    at::Tensor gu = at::empty({pairs, 2 * inter}, x.options());
    expert_products(rows, gate_up, experts, max_kernel_rows, gemm_max_rows, gu);
    // the gated activation: act(gate) * up with gate the first half of each row (silu, gelu_tanh), or
    // gpt-oss's clamped SwiGLU over interleaved features (gate even, up odd)
    at::Tensor h = at::empty({pairs, inter}, x.options());
    const float *g = gu.data_ptr<float>(), *b1 = gate_up_bias ? gate_up_bias->data_ptr<float>() : nullptr;
    float *hp = h.data_ptr<float>();
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; p++) {
            const float *row = g + p * 2 * inter, *bias = b1 ? b1 + expert_of[p] * 2 * inter : nullptr;
            for (int64_t j = 0; j < inter; j++) {
                const int64_t gi = activation == 2 ? 2 * j : j, ui = activation == 2 ? 2 * j + 1 : inter + j;
                float a = row[gi] + (bias ? bias[gi] : 0.0f), u = row[ui] + (bias ? bias[ui] : 0.0f);
                float act;
                if (activation == 2) {
                    a = std::min(a, 7.0f), u = std::min(std::max(u, -7.0f), 7.0f);
                    act = a / (1.0f + std::exp(-1.702f * a)), u = u + 1.0f;
                } else if (activation == 1) {
                    act = 0.5f * a * (1.0f + std::tanh(0.7978845608028654f * (a + 0.044715f * a * a * a)));
                } else {
                    act = a / (1.0f + std::exp(-a));
                }
                hp[p * inter + j] = act * u;
            }
        }
    });
    at::Tensor out = at::empty({pairs, hidden}, x.options());
    expert_products(h, down, experts, max_kernel_rows, gemm_max_rows, out);
    if (down_bias) out += down_bias->index_select(0, at::from_blob(expert_of.data(), {pairs}, at::kLong));
    // each token's sum over its pairs in the router's weights, in the pairs' expert order
    const float *op = out.data_ptr<float>(), *wp = wc.data_ptr<float>();
    float *yp = y.data_ptr<float>();
    at::parallel_for(0, hidden, 64, [&](int64_t c0, int64_t c1) {
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t t = order[i] / k;
            const float w = wp[order[i]];
            for (int64_t c = c0; c < c1; c++) yp[t * hidden + c] += w * op[i * hidden + c];
        }
    });
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_engine, m) {
    m.def("quantized_expert_mlps_f32(Tensor x, Tensor weights, Tensor ids, Tensor gate_up_data, "
          "Tensor gate_up_scales, Tensor? gate_up_offsets, int gate_up_group, Tensor down_data, Tensor down_scales, "
          "Tensor? down_offsets, int down_group, int num_experts, int activation, int max_kernel_rows, "
          "int gemm_max_rows, Tensor? gate_up_bias, Tensor? down_bias) -> Tensor");
    m.def("quantized_linear_f32(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, int group_size, "
          "int max_kernel_rows, int gemm_max_rows) -> Tensor");
    m.def("quantized_linear_q8x_f32(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, "
          "int group_size, int max_kernel_rows, int gemm_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) {
    m.impl("quantized_linear_f32", quantized_linear_f32);
    m.impl("quantized_linear_q8x_f32", quantized_linear_q8x_f32);
    m.impl("quantized_expert_mlps_f32", quantized_expert_mlps_f32);
}
