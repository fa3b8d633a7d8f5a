// What the two CPU attention kernels share (kernels/cpu_paged_attention.cpp
// for decode and verify steps, kernels/cpu_chunk_attention.cpp for prompt
// chunks): fp32 vectors of one register, bf16 loads and stores, the exp of
// their online softmax, and the checks of their common arguments.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace agentkv {

// GCC vector extensions of one register: 16 lanes on AVX-512 builds, 8 on
// AVX2 ones. A 16-lane vector on AVX2 is a pair of registers that GCC keeps
// in stack memory across the kernels' tiles, and a tile's 24-30 vectors do
// not fit AVX2's 16 registers: the chunk kernel built that way ran far
// slower than torch's (docs/bench_cpu_ops.md, round 3). So the tiles are
// counted in vectors, and their sizes per ISA are the kernels' constants.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vecf __attribute__((vector_size(4 * kLanes)));
typedef int32_t veci __attribute__((vector_size(4 * kLanes)));
// head_dim is a multiple of 16 up to 128 on every build; NV counts vectors.
constexpr int64_t kDimQuantum = 16, kMaxHeadDim = 128;

// Lane i holds i.
inline veci lane_index() {
  veci v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vecf splat(float x) { return vecf{} + x; }

inline vecf load_vec(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vecf load_vec(const uint16_t* p) {  // bf16 is the top half of an fp32
#ifdef __AVX512F__
  // GCC lowers the generic widening to two 256-bit halves and an insert,
  // which made the bf16 decode kernel half as fast as the fp32 one.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vecf)_mm512_slli_epi32(wide, 16);
#else
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vecf)_mm256_slli_epi32(wide, 16);
#endif
}
inline void store_vec(float* p, vecf v) { std::memcpy(p, &v, sizeof v); }

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
inline vecf exp_nonpositive(vecf x) {
  static_assert(Degree >= 1 && Degree <= 7, "the series' terms below");
  constexpr float kTerms[8] = {1.0f, 1.0f, 0.5f, 1.6666667e-1f, 4.1666668e-2f, 8.3333338e-3f, 1.3888889e-3f,
                               1.9841270e-4f};
  const veci underflow = x < -87.0f;
  x = underflow ? splat(-87.0f) : x;  // -inf included: keeps the int conversion defined
  const vecf t = x * 1.44269504088896341f;
  const vecf r = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const vecf f = (t - r) * 0.69314718055994531f;
  vecf p = splat(kTerms[Degree]);
  for (int i = Degree - 1; i >= 0; --i) p = kTerms[i] + f * p;
  const vecf scale = (vecf)((__builtin_convertvector(r, veci) + 127) << 23);
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
  TORCH_CHECK(q.size(2) % kDimQuantum == 0 && q.size(2) <= kMaxHeadDim, "head_dim must be a multiple of ", kDimQuantum,
              ", at most ", kMaxHeadDim);
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0) && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "one block table and one cu_seqlens_q entry per sequence");
}

}  // namespace agentkv
