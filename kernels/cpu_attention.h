// What the two CPU attention kernels share (kernels/cpu_paged_attention.cpp
// for decode and verify steps, kernels/cpu_chunk_attention.cpp for prompt
// chunks): 16-lane fp32 vectors, bf16 loads and stores, the exp of their
// online softmax, and the checks of their common arguments.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace agentkv {

// GCC vector extensions: one 16-lane fp32 vector, AVX512 registers where the
// CPU has them (compiled with -march=native), pairs of AVX2 ones elsewhere.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
constexpr int kLanes = 16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v16f splat(float x) { return v16f{} + x; }

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const uint16_t* p) {  // bf16 is the top half of an fp32
#ifdef __AVX512F__
  // GCC lowers the generic widening to two 256-bit halves and an insert,
  // which made the bf16 decode kernel half as fast as the fp32 one.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (v16f)_mm512_slli_epi32(wide, 16);
#else
  v16h h;
  std::memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
#endif
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  c10::BFloat16 b(x);  // round to nearest even, as torch's .to(bfloat16)
  std::memcpy(dst, &b, 2);
}

// exp(x) for x <= 0 (scores minus their running max), 0 below -87: 2^(x log2 e)
// split into 2^n 2^f with |f| <= 1/2 and 2^f by its Taylor series to Degree
// (7: relative error < 1e-8 before rounding; 4: < 5e-5, enough for a p that is
// rounded to bf16). libm's expf does not vectorize.
template <int Degree = 7>
inline v16f exp_nonpositive(v16f x) {
  static_assert(Degree >= 1 && Degree <= 7, "the series' terms below");
  constexpr float kTerms[8] = {1.0f, 1.0f, 0.5f, 1.6666667e-1f, 4.1666668e-2f, 8.3333338e-3f, 1.3888889e-3f,
                               1.9841270e-4f};
  const v16i underflow = x < -87.0f;
  x = underflow ? splat(-87.0f) : x;  // -inf included: keeps the int conversion defined
  const v16f t = x * 1.44269504088896341f;
  const v16f r = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const v16f f = (t - r) * 0.69314718055994531f;
  v16f p = splat(kTerms[Degree]);
  for (int i = Degree - 1; i >= 0; --i) p = kTerms[i] + f * p;
  const v16f scale = (v16f)((__builtin_convertvector(r, v16i) + 127) << 23);
  return underflow ? splat(0.0f) : p * scale;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// Prefetches are asm statements: GCC 12 counts __builtin_prefetch as free of
// side effects, so a function holding only prefetches is deleted at its calls
// when it is not inlined. The decode kernel compiled to no prefetch
// instruction at all, rounds 1-3 of it included (docs/bench_cpu_attention.md,
// round 4).
inline void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// bf16 rows of NV vectors run on vdpbf16ps where the CPU has it (head_dim a
// multiple of 32), widened to fp32 elsewhere. Value rows of keys 2i and 2i+1
// are interleaved into pairs by unpacklo/hi, which permute dimensions within
// each 128-bit lane: output vector 2w + h, lane 4 L + t holds dimension
// 32 w + 8 L + 4 h + t (dp_dim_slot), undone when the output is stored.
template <typename T, int NV>
constexpr bool kDotBf16 =
#ifdef __AVX512BF16__
    std::is_same_v<T, uint16_t> && NV % 2 == 0;
#else
    false;
#endif

constexpr int64_t dp_dim_slot(int64_t d) {
  return (2 * (d / 32) + (d % 8) / 4) * kLanes + (d % 32) / 8 * 4 + d % 4;
}

// Where output dimension d of a row sits in its accumulator.
template <typename T, int NV>
constexpr int64_t acc_slot(int64_t d) {
  if constexpr (kDotBf16<T, NV>) return dp_dim_slot(d);
  return d;
}

struct Strides {
  int64_t page, slot, head;  // of a K (or V) cache [P, page_size, Hkv, D]
};

// The arguments both kernels take: q [T, Hq, D], caches [P, page_size, Hkv, D]
// with head_dim innermost, out like q, int32 metadata of one step.
inline void check_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                 const at::Tensor& block_tables, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [T, Hq, D], k_cache and v_cache [P, page_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, caches and out share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only, not ", q.scalar_type());
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and Hq be a multiple of Hkv");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && out.stride(2) == 1,
              "head_dim must be the innermost, contiguous dimension");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt, "metadata tensors must be int32");
  TORCH_CHECK(cu_seqlens_q.is_contiguous() && seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "metadata tensors must be contiguous");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= 8 * kLanes, "head_dim must be a multiple of 16, at most 128");
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0) && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "one block table and one cu_seqlens_q entry per sequence");
}

}  // namespace agentkv
