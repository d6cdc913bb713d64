// The CPU backend's decode attention as native torch operators, so that a compiled graph reaches
// the kernel of paged_decode.c through the dispatcher alone: no Python between the layers.
//
// compiled_engine::paged_decode_f32 is the kernel with its plan's tensors as arguments: q, k, v and
// the output float32, the cache any page type the kernel keeps (float32, float16, bfloat16,
// float8_e4m3fn, float8_e5m2), taken from the cache tensor at each call.
//
// compiled_engine::paged_attention (the model's operator, declared in attention/op.py) gets a CPU
// kernel here. The runner installs the plan of a forward whose sequences all run in the kernel
// (set_native_decode_plan, once per forward, from attention_forward); every layer's call then
// runs the kernel straight away. Without such a plan (a prompt in the batch, another backend),
// the call goes on to compiled_engine::paged_attention_planned, the same operator implemented in
// Python by the backend that planned the forward.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <vector>

extern "C" {
int paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *slots, void *cache,
                           int kv_type, const int32_t *tables, int64_t table_width, const int32_t *lens, int64_t seqs,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size, int64_t chunk,
                           int64_t chunks, float scale, int64_t window, float soft_cap, const float *sinks,
                           float *scratch, float *out, int threads);
int64_t paged_decode_chunk_keys(int64_t work, int64_t span, int64_t page_size, int64_t threads);
}

namespace {

// paged_decode.c's kv_type of a cache's scalar type (native_decode.py's KV_TYPES), or -1.
int kv_type_of(at::ScalarType type) {
    switch (type) {
        case at::kFloat: return 0;
        case at::kHalf: return 1;
        case at::kBFloat16: return 2;
        case at::kFloat8_e4m3fn: return 3;
        case at::kFloat8_e5m2: return 4;
        default: return -1;
    }
}

at::Tensor paged_decode_f32(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &kv_cache,
                            const at::Tensor &slots, const at::Tensor &block_tables, const at::Tensor &seq_lens,
                            int64_t max_seq_len, double scale, int64_t window, double soft_cap,
                            const std::optional<at::Tensor> &sinks) {
    const char *name = "paged_decode_f32";
    const int kv_type = kv_type_of(kv_cache.scalar_type());
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous() && kv_type >= 0 &&
                    kv_cache.is_cpu(),
                name, ": a layer's cache is a contiguous float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 "
                "[pages, 2, page_size, kv_heads, head_dim] on the CPU, not ", kv_cache.scalar_type(), " ",
                kv_cache.sizes());
    const int64_t page_size = kv_cache.size(2), kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
    const int64_t seqs = slots.numel();
    TORCH_CHECK(q.dim() == 3 && q.size(0) == seqs && q.size(2) == dim && q.scalar_type() == at::kFloat, name,
                ": q must be float32 [", seqs, ", heads, ", dim, "]");
    TORCH_CHECK(k.dim() == 3 && k.size(0) == seqs && k.size(1) == kv_heads && k.size(2) == dim &&
                    k.sizes() == v.sizes() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                name, ": k and v must be float32 [", seqs, ", ", kv_heads, ", ", dim, "]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && block_tables.dim() == 2 &&
                    block_tables.size(0) == seqs && block_tables.scalar_type() == at::kInt &&
                    block_tables.is_contiguous() && seq_lens.numel() == seqs &&
                    seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
                name, ": the plan's slots (int64), block tables (int32 [seqs, pages]) and lengths (int32) disagree");
    TORCH_CHECK(window >= 0 && soft_cap >= 0, name, ": window and soft_cap must not be negative");
    const int64_t heads = q.size(1);
    TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == heads &&
                                       sinks->scalar_type() == at::kFloat && sinks->is_cpu()),
                name, ": sinks must be float32 [", heads, "] (one per query head) on the CPU");
    const at::Tensor sink_values = sinks.has_value() ? sinks->contiguous() : at::Tensor();
    if (seqs == 0) return at::empty_like(q);
    const int threads = at::get_num_threads();
    // A windowed layer splits its window's span rather than the longest context.
    const int64_t span = window > 0 && window < max_seq_len ? window : max_seq_len;
    const int64_t chunk = paged_decode_chunk_keys(seqs, span, page_size, threads);
    const int64_t chunks = (span + chunk - 1) / chunk;
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    at::Tensor out = at::empty_like(qc);
    at::Tensor scratch = at::empty({seqs * heads * chunks * (dim + 2)}, q.options());
    const int status = paged_decode_attention(
        qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), slots.data_ptr<int64_t>(),
        kv_cache.data_ptr(), kv_type, block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
        seqs, heads, kv_heads, dim, page_size, chunk, chunks, static_cast<float>(scale), window,
        static_cast<float>(soft_cap), sinks.has_value() ? sink_values.data_ptr<float>() : nullptr,
        scratch.data_ptr<float>(), out.data_ptr<float>(), threads);
    TORCH_CHECK(status == 0, name, ": the kernel refused its shapes (status ", status, ")");
    return out;
}

// The forward's plan when every sequence runs in the kernel; unset otherwise. Its index tensors
// were checked against the layer caches' shape, and their page ids and slots against its bounds,
// once for the forward (NativeDecode.plan in native_decode.py); each call checks its cache has
// that shape.
struct NativePlan {
    at::Tensor slots, block_tables, seq_lens;
    int64_t max_seq_len = 0;
    std::vector<int64_t> cache_shape;
};
std::optional<NativePlan> current_plan;

void set_native_decode_plan(const std::optional<at::Tensor> &slots, const std::optional<at::Tensor> &block_tables,
                            const std::optional<at::Tensor> &seq_lens, int64_t max_seq_len,
                            at::IntArrayRef cache_shape) {
    if (!slots.has_value()) {
        current_plan.reset();
        return;
    }
    TORCH_CHECK(block_tables.has_value() && seq_lens.has_value() && max_seq_len > 0 && cache_shape.size() == 5,
                "set_native_decode_plan: slots, block tables, lengths, a positive max_seq_len and a layer's "
                "cache shape go together");
    current_plan = NativePlan{*slots, *block_tables, *seq_lens, max_seq_len, cache_shape.vec()};
}

at::Tensor paged_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                               const at::Tensor &kv_cache, double scale, int64_t window, double soft_cap,
                               const std::optional<at::Tensor> &sinks) {
    if (current_plan.has_value()) {
        const NativePlan &plan = *current_plan;
        TORCH_CHECK(kv_cache.sizes() == at::IntArrayRef(plan.cache_shape), "paged_attention: the installed plan is for "
                    "layer caches of shape ", at::IntArrayRef(plan.cache_shape), ", not ", kv_cache.sizes());
        return paged_decode_f32(q, k, v, kv_cache, plan.slots, plan.block_tables, plan.seq_lens, plan.max_seq_len,
                                scale, window, soft_cap, sinks);
    }
    static const auto planned = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("compiled_engine::paged_attention_planned", "")
                                    .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                                      const at::Tensor &, double, int64_t, double,
                                                      const std::optional<at::Tensor> &)>();
    return planned.call(q, k, v, kv_cache, scale, window, soft_cap, sinks);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_engine, m) {
    m.def("paged_decode_f32(Tensor q, Tensor k, Tensor v, Tensor kv_cache, Tensor slots, Tensor block_tables, "
          "Tensor seq_lens, int max_seq_len, float scale, int window=0, float soft_cap=0.0, Tensor? sinks=None) "
          "-> Tensor");
    m.def("set_native_decode_plan(Tensor? slots, Tensor? block_tables, Tensor? seq_lens, int max_seq_len, "
          "int[] cache_shape) -> ()",
          set_native_decode_plan);
}

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) {
    m.impl("paged_decode_f32", paged_decode_f32);
    m.impl("paged_attention", paged_attention_cpu);
}
