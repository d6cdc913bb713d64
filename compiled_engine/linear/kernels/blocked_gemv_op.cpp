// compiled_engine::blocked_gemv_f32: the product of a few fp32 rows with a weight in oneDNN's
// blocked layout (blocked_gemv.c) as a native torch operator, so that a compiled graph calls the
// kernel through the dispatcher alone. The weight is the [out / B, in, B] view of the packed
// copy that compiled_engine/linear/packed_cpu.py makes, B being the block width oneDNN chose.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

extern "C" {
int blocked_gemv_max_block(void);
int blocked_gemv_lanes(void);
int blocked_gemv_max_rows(void);
int blocked_gemv_f32(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, int64_t block,
                     const float *bias, float *y, int threads);
}

namespace {

at::Tensor blocked_gemv_f32_op(const at::Tensor &x, const at::Tensor &blocked, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(blocked.dim() == 3 && blocked.is_contiguous() && blocked.scalar_type() == at::kFloat &&
                    blocked.is_cpu(),
                "blocked_gemv_f32: the weight must be a contiguous float32 [out / B, in, B] on the CPU");
    const int64_t block = blocked.size(2), lanes = blocked_gemv_lanes(), max_block = blocked_gemv_max_block();
    TORCH_CHECK(block >= lanes && block <= max_block && block % lanes == 0, "blocked_gemv_f32: takes blocks of ",
                lanes, " to ", max_block, " outputs in steps of ", lanes, ", got ", block);
    const int64_t in = blocked.size(1), out = blocked.size(0) * block;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == at::kFloat && x.is_cpu(),
                "blocked_gemv_f32: x must be float32 [rows, ", in, "] on the CPU");
    const int64_t rows = x.size(0);
    TORCH_CHECK(rows >= 1 && rows <= blocked_gemv_max_rows(), "blocked_gemv_f32: takes 1 to ",
                blocked_gemv_max_rows(), " rows, got ", rows);
    TORCH_CHECK(!bias || (bias->numel() == out && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
                "blocked_gemv_f32: bias must be float32 [", out, "]");
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({rows, out}, x.options());
    const int status = blocked_gemv_f32(xc.data_ptr<float>(), rows, in, blocked.data_ptr<float>(), out, block,
                                        bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                                        at::get_num_threads());
    TORCH_CHECK(status == 0, "blocked_gemv_f32: the kernel refused [", out, ", ", in, "] (status ", status, ")");
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_engine, m) {
    m.def("blocked_gemv_f32(Tensor x, Tensor blocked, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) { m.impl("blocked_gemv_f32", blocked_gemv_f32_op); }
