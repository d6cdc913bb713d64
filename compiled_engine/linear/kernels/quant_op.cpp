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
#include <torch/library.h>

#include <optional>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_engine, m) {
    m.def("quantized_linear_f32(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, int group_size, "
          "int max_kernel_rows, int gemm_max_rows) -> Tensor");
    m.def("quantized_linear_q8x_f32(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, "
          "int group_size, int max_kernel_rows, int gemm_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) {
    m.impl("quantized_linear_f32", quantized_linear_f32);
    m.impl("quantized_linear_q8x_f32", quantized_linear_q8x_f32);
}
