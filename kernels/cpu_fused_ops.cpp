// Fused per-layer CPU ops of a forward: residual add + RMSNorm, RoPE + K/V
// store, and the MLP's SiLU(gate) * up. Each replaces 4-17 torch ops a layer,
// whose dispatch costs a decode step of a small model more than their
// arithmetic.
//
// Both give the bits of their torch references (kernels/reference.py):
// every rounding step is the reference's, in its order. That needs
// -ffp-contract=off (kernels/cpu_fused_ops.py builds with it): a fused
// multiply-add rounds once where the reference's mul then add rounds twice.
// Every row (token) is computed on its own, so a row's bits never depend on
// what else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return float(x); }
template <typename T>
inline T narrow(float x) {
  return T(x);  // c10::BFloat16(float) rounds to nearest even, as .to(bfloat16)
}

// ---------------------------------------------------------------------------
// The sum of a row's squares in ATen's order (aten/src/ATen/native/cpu/
// SumKernel.cpp, cascade_sum), which `pow(2).mean(-1)` runs: rows of at
// least kLanes floats are summed as 8-lane vectors by row_sum (4 interleaved
// accumulators, each a 4-level cascade of 16-element chunks), then the
// scalar tail, then the lanes in order; shorter rows by row_sum over
// scalars. 8 lanes on AVX512 CPUs too: sum_stub is registered with
// REGISTER_DISPATCH, which leaves AVX512 CPUs on the AVX2 kernel (16-lane
// sums matched torch.sum in about half the rows tried, 8-lane ones in all).
constexpr int kLanes = 8;
typedef float v8f __attribute__((vector_size(4 * kLanes)));

inline int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// ATen's multi_row_sum with 4 rows: element (i, k) is data[i * 4 + k].
template <typename A>
void multi_row_sum4(const A* data, int64_t size, A out[4]) {
  constexpr int kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  A acc[kLevels][4];
  for (auto& level : acc)
    for (auto& a : level) a = A{};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] += data[i * 4 + k];
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = A{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] += data[i * 4 + k];
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  for (int k = 0; k < 4; ++k) out[k] = acc[0][k];
}

// ATen's row_sum: 4 accumulators over the row seen as [size / 4, 4], the
// leftover elements into the first, then the four in order.
template <typename A>
A row_sum(const A* data, int64_t size) {
  const int64_t size_ilp = size / 4;
  A partial[4];
  multi_row_sum4(data, size_ilp, partial);
  for (int64_t i = size_ilp * 4; i < size; ++i) partial[0] += data[i];
  for (int k = 1; k < 4; ++k) partial[0] += partial[k];
  return partial[0];
}

// sq: n floats at the start of a buffer aligned for v8f (GCC's vector types
// alias their element type).
float sum_in_aten_order(const float* sq, int64_t n) {
  if (n < kLanes) return row_sum(sq, n);
  const int64_t num_vecs = n / kLanes;
  const v8f acc = row_sum(reinterpret_cast<const v8f*>(sq), num_vecs);
  float total = 0.0f;
  for (int64_t k = num_vecs * kLanes; k < n; ++k) total += sq[k];
  for (int k = 0; k < kLanes; ++k) total += acc[k];
  return total;
}

// One row: h = x (+ residual), rounded to T; out = weight * normalized h as
// reference.rmsnorm rounds it: fp32 (h * rstd) * weight, as aten::rms_norm;
// bf16 weight * bf16(h * rstd), as Hugging Face's LlamaRMSNorm.
template <typename T>
void norm_row(const T* x, const T* residual, const T* weight, float eps, int64_t n, T* h_out, T* out,
              float* hf, float* sq) {
  for (int64_t i = 0; i < n; ++i) {
    T h = residual ? narrow<T>(widen(x[i]) + widen(residual[i])) : x[i];
    if (h_out) h_out[i] = h;
    hf[i] = widen(h);
    sq[i] = hf[i] * hf[i];
  }
  // mean(-1) is sum then div_ by the count, in fp32; then + eps, rsqrt (1 / sqrt).
  const float mean = sum_in_aten_order(sq, n) / static_cast<float>(n);
  const float rstd = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = (hf[i] * rstd) * weight[i];
    } else {
      out[i] = narrow<T>(widen(weight[i]) * widen(narrow<T>(hf[i] * rstd)));
    }
  }
}

// Rows per parallel task: a decode step's few rows run inline on the caller.
constexpr int64_t kNormGrainElements = 1 << 15;

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor* h,
               at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* hp = h ? h->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const float eps_f = static_cast<float>(eps);  // aten::rms_norm and `+ eps` on fp32 both add it as a float
  at::parallel_for(0, rows, std::max<int64_t>(1, kNormGrainElements / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> hf(n);
    std::vector<v8f> sq((n + kLanes - 1) / kLanes);
    float* sqp = reinterpret_cast<float*>(sq.data());
    for (int64_t r = begin; r < end; ++r) {
      const int64_t o = r * n;
      norm_row<T>(xp + o, rp ? rp + o : nullptr, wp, eps_f, n, hp ? hp + o : nullptr, op + o, hf.data(), sqp);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                    "float32 or bfloat16 only, not ", x.scalar_type());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight must be of x's dtype");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
                    "weight must be a contiguous [hidden] tensor");
}

// weight * x / rms(x), as reference.rmsnorm without a residual.
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x, nullptr, weight, eps, nullptr, out);
  else
    norm_rows<c10::BFloat16>(x, nullptr, weight, eps, nullptr, out);
  return out;
}

// h = x + residual; (weight * h / rms(h), h), as reference.rmsnorm with one.
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                        residual.is_contiguous() && residual.device().is_cpu(),
                    "residual must be a contiguous CPU tensor shaped like x, of its dtype");
  at::Tensor out = at::empty_like(x), h = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x, &residual, weight, eps, &h, out);
  else
    norm_rows<c10::BFloat16>(x, &residual, weight, eps, &h, out);
  return {out, h};
}

// ---------------------------------------------------------------------------
// RoPE + K/V store. HF's rotate_half convention over halves of head_dim, in
// fp32 as reference._rotate: first half x1 * c + x2 * (-s), second x2 * c +
// x1 * s, each product rounded, then the sum.

struct Strided {
  int64_t s0, s1, s2;  // [T, heads, D]
};

template <typename T, bool UnitD>
inline void rotate(const T* src, int64_t src_d, T* dst, int64_t dst_d, const float* c, const float* s, int64_t half) {
  const int64_t sd = UnitD ? 1 : src_d, dd = UnitD ? 1 : dst_d;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(src[i * sd]), x2 = widen(src[(i + half) * sd]);
    const float r1 = x1 * c[i] + x2 * (-s[i]);
    const float r2 = x2 * c[i] + x1 * s[i];
    dst[i * dd] = narrow<T>(r1);
    dst[(i + half) * dd] = narrow<T>(r2);
  }
}

// Tokens per parallel task: a decode step's run inline on the caller.
constexpr int64_t kRopeGrainTokens = 64;

template <typename T, bool UnitD>
void rope_store_tokens(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* pos,
                       const int64_t* slots, int64_t pos_stride, int64_t slot_stride) {
  const int64_t tokens = q.size(0), hq = q.size(1), hkv = k.size(1), dim = q.size(2), half = dim / 2;
  const int64_t page_size = k_cache.size(1);
  T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, kRopeGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t * pos_stride], slot = slots[t * slot_stride];
      const float* c = cp + p * cs;
      const float* s = sp + p * ss;
      const int64_t page = slot / page_size, off = slot % page_size;
      for (int64_t h = 0; h < hq; ++h) {
        T* x = qp + t * q.stride(0) + h * q.stride(1);
        rotate<T, UnitD>(x, q.stride(2), x, q.stride(2), c, s, half);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t at_k = page * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2);
        const int64_t at_v = page * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2);
        rotate<T, UnitD>(kp + t * k.stride(0) + h * k.stride(1), k.stride(2), kc + at_k, k_cache.stride(3), c, s, half);
        const T* src = vp + t * v.stride(0) + h * v.stride(1);
        T* dst = vc + at_v;
        for (int64_t d = 0; d < dim; ++d) dst[d * (UnitD ? 1 : v_cache.stride(3))] = src[d * (UnitD ? 1 : v.stride(2))];
      }
    }
  });
}

// Rotates q [T, Hq, D] in place at positions [T]; writes k [T, Hkv, D]
// rotated and v as is into slot slot_mapping[t] (page * page_size + offset)
// of k_cache / v_cache [P, page_size, Hkv, D]. Any strides. Checks every
// position and slot before writing anything.
void rope_and_store(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& positions,
                    const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &k_cache, &v_cache,
                                                                       &positions, &slot_mapping})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "CPU tensors only");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                    "float32 or bfloat16 only, not ", q.scalar_type());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &k_cache, &v_cache})
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), "q, k, v and the caches share one dtype");
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [T, Hq, D], k and v [T, Hkv, D]");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "k_cache and v_cache [P, page_size, Hkv, D]");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK_VALUE(k.size(0) == tokens && k.size(2) == dim && k_cache.size(2) == k.size(1) &&
                        k_cache.size(3) == dim, "q, k, v and the caches disagree on T, Hkv or head_dim");
  TORCH_CHECK_VALUE(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                        sin.sizes() == cos.sizes() && cos.size(1) == dim / 2 && cos.stride(1) == 1 &&
                        sin.stride(1) == 1, "cos and sin must be float32 [max_pos, head_dim / 2], rows contiguous");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                        positions.dim() == 1 && slot_mapping.dim() == 1 && positions.size(0) == tokens &&
                        slot_mapping.size(0) == tokens, "positions and slot_mapping must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ps = positions.stride(0), ss = slot_mapping.stride(0);
  const int64_t max_pos = cos.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_INDEX(pos[t * ps] >= 0 && pos[t * ps] < max_pos, "position ", pos[t * ps], " is outside the ",
                      max_pos, "-row RoPE tables");
    TORCH_CHECK_INDEX(slots[t * ss] >= 0 && slots[t * ss] < num_slots, "slot ", slots[t * ss],
                      " is outside the cache's ", num_slots, " slots");
  }
  const bool unit = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
                    v_cache.stride(3) == 1;
#define AGENTKV_ROPE(T)                                                                                     \
  (unit ? rope_store_tokens<T, true>(q, k, v, cos, sin, k_cache, v_cache, pos, slots, ps, ss)               \
        : rope_store_tokens<T, false>(q, k, v, cos, sin, k_cache, v_cache, pos, slots, ps, ss))
  if (q.scalar_type() == at::kFloat)
    AGENTKV_ROPE(float);
  else
    AGENTKV_ROPE(c10::BFloat16);
#undef AGENTKV_ROPE
}

// ---------------------------------------------------------------------------
// SiLU(gate) * up over rows [gate | up] of the fused gate/up projection, as
// reference.silu_mul: silu rounded to T, then the product rounded. silu is
// x / (1 + exp(-x)) in fp32 as aten::silu computes it. Its kernel runs on
// ATen's widest vectors (silu_stub is dispatched to AVX512 where the CPU has
// it, unlike sum_stub): exp comes from Sleef (exported by libtorch_cpu) over
// each row's whole chunks of two vectors (2 * vector_bytes / sizeof(T)
// elements) and from std::exp over the rest, and
// each element takes the same path here. (ATen splits rows of more than
// 32768 elements a step between threads wherever the split falls, which
// moves that tail; rows here are split by row only, so their bits never
// depend on the batch.)
#ifdef __AVX512F__
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif
#ifdef __AVX2__
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }

// buf[0, n) = silu(buf) in place, for n a multiple of vector_bytes / 4 lanes.
void silu_vectors(float* buf, int64_t n, int64_t vector_bytes) {
#ifdef __AVX512F__
  if (vector_bytes == 64) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t k = 0; k < n; k += 16) {
      const __m512 x = _mm512_loadu_ps(buf + k);
      const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
      _mm512_storeu_ps(buf + k, _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(neg))));
    }
    return;
  }
#endif
#ifdef __AVX2__
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 x = _mm256_loadu_ps(buf + k);
    _mm256_storeu_ps(buf + k, _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign)))));
  }
#else
  for (int64_t k = 0; k < n; ++k) buf[k] = silu_scalar(buf[k]);  // ATen's default build maps std::exp too
#endif
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n, int64_t vector_bytes, float* buf) {
  const int64_t chunk = 2 * vector_bytes / static_cast<int64_t>(sizeof(T));
  const int64_t whole = n / chunk * chunk;
  for (int64_t k = 0; k < whole; ++k) buf[k] = widen(gate[k]);
  silu_vectors(buf, whole, vector_bytes);
  for (int64_t k = 0; k < whole; ++k) out[k] = narrow<T>(widen(narrow<T>(buf[k])) * widen(up[k]));
  for (int64_t k = whole; k < n; ++k) out[k] = narrow<T>(widen(narrow<T>(silu_scalar(widen(gate[k])))) * widen(up[k]));
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t vector_bytes) {
  // A build without AVX512 still follows ATen's AVX512 split (64): Sleef's
  // 8-lane exp gives each element the bits of its 16-lane one.
  TORCH_CHECK_VALUE(vector_bytes == 32 || vector_bytes == 64, "vector_bytes must be 32 or 64");
  TORCH_CHECK_VALUE(gate_up.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK_VALUE(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
                    "float32 or bfloat16 only, not ", gate_up.scalar_type());
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
                    "gate_up must be [T, 2 * intermediate] with contiguous rows");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      using T = float;
      const T* in = gate_up.data_ptr<T>();
      T* o = out.data_ptr<T>();
      at::parallel_for(0, rows, std::max<int64_t>(1, kNormGrainElements / std::max<int64_t>(n, 1)),
                       [&](int64_t begin, int64_t end) {
        std::vector<float> buf(n);
        for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * stride, in + r * stride + n, o + r * n, n, vector_bytes, buf.data());
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      const T* in = gate_up.data_ptr<T>();
      T* o = out.data_ptr<T>();
      at::parallel_for(0, rows, std::max<int64_t>(1, kNormGrainElements / std::max<int64_t>(n, 1)),
                       [&](int64_t begin, int64_t end) {
        std::vector<float> buf(n);
        for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * stride, in + r * stride + n, o + r * n, n, vector_bytes, buf.data());
      });
    }));
  return out;
}

}  // namespace

AGENTKV_LIBRARY(agentkv_cpu_fused, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, int vector_bytes) -> Tensor");
  m.def("rope_and_store(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor positions, Tensor slot_mapping) -> ()");
}

AGENTKV_LIBRARY_IMPL(agentkv_cpu_fused, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("rope_and_store", &rope_and_store);
  m.impl("silu_mul", &silu_mul);
}
