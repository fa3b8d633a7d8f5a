// A CPU forward's layers in one call: every decoder layer of a step (add +
// RMSNorm, qkv linear, Qwen3's per-head q/k RMSNorm where the model has it,
// RoPE + K/V store, paged attention, o linear, add +
// RMSNorm, gate_up linear, SiLU * up, down linear), then the final norm and
// the LM head, run by calling the registered C++ ops of kernels/cpu_linear.cpp,
// kernels/cpu_fused_ops.cpp and kernels/cpu_paged_attention.cpp through typed
// dispatcher handles looked up once. The ops and their order are the Python
// loop's (model/llama.py, Transformer.forward), so the logits are its bits;
// what goes is the Python between them, a large share of a small model's
// step (docs/bench_host_step.md).
//
// A Layers object is made once per (packed weights, page pool): the embedding
// table, the layers' weights, packed linears and K/V page views are handed
// over then, and a step passes only its token ids and metadata. The lookup is
// the loop's too: after a forward has streamed the K/V through the caches, a
// torch op called from Python costs more than from here (the interpreter's
// code and data have left the caches).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_library.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

// The other extensions' ops, by schema. Their C++ signatures must be these
// exactly (typed() checks): a change there fails here at the first Layers, and
// kernels/cpu_layers.py then keeps the Python loop.
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rmsnorm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rmsnorm;
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor,
                                const Tensor&, const Tensor&)>
      rope_and_store;
  c10::TypedOperatorHandle<Tensor(const Tensor&, int64_t)> silu_mul;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)> linear;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, double, int64_t, int64_t, int64_t, int64_t, Tensor)>
      attention;
};

template <typename F>
c10::TypedOperatorHandle<F> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

const Ops& ops() {
  static const Ops o{
      handle<Tensor(const Tensor&, const Tensor&, double)>(AGENTKV_OP("agentkv_cpu_fused", "rmsnorm")),
      handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
          AGENTKV_OP("agentkv_cpu_fused", "add_rmsnorm")),
      handle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&,
                  const Tensor&)>(AGENTKV_OP("agentkv_cpu_fused", "rope_and_store")),
      handle<Tensor(const Tensor&, int64_t)>(AGENTKV_OP("agentkv_cpu_fused", "silu_mul")),
      handle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>(AGENTKV_OP("agentkv_cpu_linear", "linear")),
      handle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                  int64_t, int64_t, int64_t, int64_t, Tensor)>(AGENTKV_OP("agentkv_cpu", "paged_attention_few")),
  };
  return o;
}

// A linear's packed weight (kernels/cpu_linear.py's PackedLinear.data), its
// bias (or none) and its output count.
struct Linear {
  Tensor packed;
  OptTensor bias;
  int64_t out;
  Tensor operator()(const Tensor& x) const { return ops().linear.call(x, packed, bias, out); }
};

struct Layer {
  Tensor attn_norm, mlp_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
  int64_t window;
  OptTensor q_norm, k_norm;  // [head_dim] each, or none (Qwen3 has them)
};

struct Layers : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim, vector_bytes;
  double eps, scale;
  Tensor embed, cos, sin, final_norm;
  Linear lm_head;
  std::vector<Layer> layers;

  Layers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, Tensor embed,
         Tensor cos, Tensor sin, Tensor final_norm, Tensor lm_head, int64_t vocab, int64_t vector_bytes)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), vector_bytes(vector_bytes), eps(eps),
        scale(scale), embed(std::move(embed)), cos(std::move(cos)), sin(std::move(sin)),
        final_norm(std::move(final_norm)), lm_head{std::move(lm_head), c10::nullopt, vocab} {
    TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                      "heads must be positive, num_heads a multiple of num_kv_heads");
    TORCH_CHECK_VALUE(this->embed.dim() == 2 && this->embed.size(1) == this->final_norm.numel(),
                      "embed must be [vocab, hidden]");
    ops();  // every handle looked up now: a missing or changed op fails here, not mid-step
  }

  void add_layer(Tensor attn_norm, Tensor qkv, OptTensor qkv_bias, Tensor o, OptTensor o_bias, Tensor mlp_norm,
                 Tensor gate_up, OptTensor gate_up_bias, Tensor down, OptTensor down_bias, int64_t intermediate,
                 Tensor k_cache, Tensor v_cache, int64_t window, OptTensor q_norm, OptTensor k_norm) {
    const int64_t hidden = attn_norm.numel(), q_dim = num_heads * head_dim;
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim &&
                          v_cache.sizes() == k_cache.sizes(),
                      "k_cache and v_cache must be [pages, page_size, num_kv_heads, head_dim]");
    TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value() &&
                          (!q_norm.has_value() || (q_norm->numel() == head_dim && k_norm->numel() == head_dim)),
                      "q_norm and k_norm must both be [head_dim], or both none");
    layers.push_back({std::move(attn_norm), std::move(mlp_norm), std::move(k_cache), std::move(v_cache),
                      {std::move(qkv), std::move(qkv_bias), q_dim + 2 * num_kv_heads * head_dim},
                      {std::move(o), std::move(o_bias), hidden},
                      {std::move(gate_up), std::move(gate_up_bias), 2 * intermediate},
                      {std::move(down), std::move(down_bias), hidden},
                      window,
                      std::move(q_norm),
                      std::move(k_norm)});
  }

  // ids [R]: the step's t tokens then R - t valid ids run as padding rows; o_rows [R, heads * head_dim], the rows the attention writes (its
  // first t as [t, heads, head_dim]) and the o projection reads
  // (ForwardScratch.attention_rows). Every sequence must have at most
  // max_queries queries (the caller runs longer chunks in Python, where the
  // reference attention takes them); max_queries, split and prefetch are passed
  // on to the attention. Returns fp32 logits at logit_indices, or at all t tokens.
  Tensor forward(const Tensor& ids, Tensor o_rows, Tensor positions, Tensor slot_mapping, Tensor cu_seqlens_q,
                 Tensor seq_lens, Tensor block_tables, OptTensor logit_indices, int64_t max_queries,
                 int64_t split, int64_t prefetch) const {
    c10::InferenceMode guard;
    const Ops& f = ops();
    const int64_t t = positions.size(0), rows = ids.size(0), hq = num_heads, hkv = num_kv_heads, d = head_dim;
    TORCH_CHECK_VALUE(!layers.empty(), "no layers added");
    TORCH_CHECK_VALUE(ids.dim() == 1 && t <= rows && slot_mapping.size(0) == t, "ids must be [R >= T]");
    TORCH_CHECK_VALUE(o_rows.dim() == 2 && o_rows.size(0) == rows && o_rows.size(1) == hq * d && o_rows.is_contiguous(),
                      "o_rows must be a contiguous [R, num_heads * head_dim]");
    const Tensor o_heads = o_rows.narrow(0, 0, t).view({t, hq, d});
    Tensor h = at::embedding(embed, ids), x, residual;  // an id out of the vocabulary: IndexError, nothing written
    for (const Layer& l : layers) {
      if (residual.defined()) {
        std::tie(x, residual) = f.add_rmsnorm.call(h, residual, l.attn_norm, eps);
      } else {
        x = f.rmsnorm.call(h, l.attn_norm, eps);
        residual = h;
      }
      // q, k and v: views of the first t rows of the fused projection by head.
      const Tensor qkv = l.qkv(x);
      const int64_t off = qkv.storage_offset(), s0 = qkv.stride(0);
      Tensor q = qkv.as_strided({t, hq, d}, {s0, d, 1}, off);
      Tensor k = qkv.as_strided({t, hkv, d}, {s0, d, 1}, off + hq * d);
      const Tensor v = qkv.as_strided({t, hkv, d}, {s0, d, 1}, off + (hq + hkv) * d);
      if (l.q_norm.has_value()) {  // as kernels/cpu_fused_ops.py's rope_and_store: normalized into fresh rows
        q = f.rmsnorm.call(q.contiguous(), *l.q_norm, eps);
        k = f.rmsnorm.call(k.contiguous(), *l.k_norm, eps);
      }
      f.rope_and_store.call(q, k, v, cos, sin, l.k_cache, l.v_cache, positions, slot_mapping);
      f.attention.call(q, l.k_cache, l.v_cache, cu_seqlens_q, seq_lens, block_tables, scale, l.window, max_queries,
                       split, prefetch, o_heads);
      h = l.o(o_rows);
      std::tie(x, residual) = f.add_rmsnorm.call(h, residual, l.mlp_norm, eps);
      h = l.down(f.silu_mul.call(l.gate_up(x), vector_bytes));
    }
    if (logit_indices.has_value()) {
      h = h.index_select(0, *logit_indices);
      residual = residual.index_select(0, *logit_indices);
    }
    Tensor logits = lm_head(std::get<0>(f.add_rmsnorm.call(h, residual, final_norm, eps)));
    if (!logit_indices.has_value() && logits.size(0) > t) logits = logits.narrow(0, 0, t);  // the padding rows'
    return logits.to(at::kFloat);
  }
};

}  // namespace

AGENTKV_LIBRARY(agentkv_cpu_layers, m) {
  m.class_<Layers>("Layers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t,
                       int64_t>())
      .def("add_layer", &Layers::add_layer)
      .def("forward", &Layers::forward);
}
