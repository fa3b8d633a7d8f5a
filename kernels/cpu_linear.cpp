// CPU linear y = x @ W (+ b) for the model's weights, packed once into blocks
// of 16 outputs that the kernel streams front to back:
//   fp32: [out/16][in][16]          one FMA per input per 16 outputs
//   bf16: [out/16][ceil(in/2)][16][2] pairs of inputs, as vdpbf16ps takes them
// Work is split over output blocks (both cores busy at one row); each thread
// runs tiles of up to kRows rows x 4 blocks (bf16: 8 at 1-2 rows) over its blocks. No software
// prefetch: each tile reads 4 sequential streams, which the hardware
// prefetchers follow; _mm_prefetch 512 B - 4 KiB ahead measured no faster
// (a SmolLM2 decode step's linears, bf16, one thread: 18-20 against 22 GB/s
// without, docs/bench_cpu_linear.md).
//
// Bit invariance: every output element accumulates over `in` in the same
// order with the same instruction whatever the tile it falls in (a tile's
// rows and blocks only share loads), so a row's result does not depend on
// how many rows share the call or where it sits among them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block: one fp32 vector
constexpr int kVecs = 4;        // blocks per tile
constexpr int kRows = 6;        // rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 registers
// bf16 blocks per tile at up to kWideRows rows (a decode step's one row): 8
// streams in flight rather than 4, 2 x 8 accumulators + 8 weights + 1
// broadcast registers. At one row and 4 blocks, bf16 on one core read its
// weights at 73-90% of a plain read, at 8 blocks 97%; fp32 (96% at 4) got
// slower at 8 (docs/bench_cpu_linear.md, round 2).
constexpr int kWideVecs = 8;
constexpr int kWideRows = 2;

#ifdef __AVX512F__

inline __m512 bias_vec(const float* b, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), b);
}
inline __m512 bias_vec(const c10::BFloat16* b, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), b);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_vec(float* dst, __m512 v, int64_t n) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), v);
}
// Round to nearest even as c10::BFloat16 (torch's .to(bfloat16)) does, NaN
// to 0x7fc0; vcvtneps2bf16 would flush denormals, which torch keeps.
inline void store_vec(c10::BFloat16* dst, __m512 v, int64_t n) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1), _mm512_cvtepi32_epi16(r));
}

template <typename T>
struct Args {
  const T* x;
  int64_t ldx;
  const T* w;          // packed
  int64_t block_len;   // elements of one packed block
  const T* bias;       // nullptr: none
  T* y;
  int64_t ldy;
  int64_t in, out;
};

// acc[r][v] += x[r] . W over all of `in`, in input order.
template <int R, int V>
inline void tile_fp32(const Args<float>& a, int64_t row, int64_t blk, __m512 (&acc)[R][V]) {
  const float* w[V];
  for (int v = 0; v < V; ++v) w[v] = a.w + (blk + v) * a.block_len;
  const float* x = a.x + row * a.ldx;
  for (int64_t k = 0; k < a.in; ++k) {
    __m512 wv[V];
    for (int v = 0; v < V; ++v) {
      wv[v] = _mm512_loadu_ps(w[v] + k * kBlock);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * a.ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
}

#ifdef __AVX512BF16__
template <int R, int V>
inline void tile_bf16(const Args<c10::BFloat16>& a, int64_t row, int64_t blk, __m512 (&acc)[R][V]) {
  const uint16_t* w[V];
  for (int v = 0; v < V; ++v) w[v] = reinterpret_cast<const uint16_t*>(a.w + (blk + v) * a.block_len);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(a.x + row * a.ldx);
  const int64_t pairs = a.in / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) {
      wv[v] = (__m512bh)_mm512_loadu_si512(w[v] + p * 2 * kBlock);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * a.ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
  if (a.in % 2) {  // the last input pairs with a zero (the packed weight's pad is zero too)
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w[v] + pairs * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * a.ldx + a.in - 1]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
}
#endif

template <typename T, int R, int V>
void tile(const Args<T>& a, int64_t row, int64_t blk) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    tile_fp32<R, V>(a, row, blk, acc);
  } else {
#ifdef __AVX512BF16__
    tile_bf16<R, V>(a, row, blk, acc);
#endif
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = (blk + v) * kBlock;
    const int64_t n = std::min<int64_t>(kBlock, a.out - col);
    const __m512 b = a.bias ? bias_vec(a.bias + col, n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      // The bias is added to the finished sum, as addmm does, then rounded once.
      store_vec(a.y + (row + r) * a.ldy + col, a.bias ? _mm512_add_ps(acc[r][v], b) : acc[r][v], n);
    }
  }
}

template <typename T, int R>
void tile_rows(const Args<T>& a, int64_t row, int64_t blk, int v) {
  if constexpr (R <= kWideRows) {
    switch (v) {
      case 8: return tile<T, R, 8>(a, row, blk);
      case 7: return tile<T, R, 7>(a, row, blk);
      case 6: return tile<T, R, 6>(a, row, blk);
      case 5: return tile<T, R, 5>(a, row, blk);
    }
  }
  switch (v) {
    case 4: return tile<T, R, 4>(a, row, blk);
    case 3: return tile<T, R, 3>(a, row, blk);
    case 2: return tile<T, R, 2>(a, row, blk);
    default: return tile<T, R, 1>(a, row, blk);
  }
}

template <typename T>
void run_tile(const Args<T>& a, int64_t row, int r, int64_t blk, int v) {
  switch (r) {
    case 6: return tile_rows<T, 6>(a, row, blk, v);
    case 5: return tile_rows<T, 5>(a, row, blk, v);
    case 4: return tile_rows<T, 4>(a, row, blk, v);
    case 3: return tile_rows<T, 3>(a, row, blk, v);
    case 2: return tile_rows<T, 2>(a, row, blk, v);
    default: return tile_rows<T, 1>(a, row, blk, v);
  }
}

template <typename T>
void run(const Args<T>& a, int64_t rows) {
  const int64_t blocks = (a.out + kBlock - 1) / kBlock;
  const int vecs = !std::is_same_v<T, float> && rows <= kWideRows ? kWideVecs : kVecs;
  // One chunk of blocks per thread: at a few rows the weights are the whole
  // cost, and each thread streams its share once.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; blk += vecs) {
      const int v = static_cast<int>(std::min<int64_t>(vecs, b1 - blk));
      for (int64_t row = 0; row < rows; row += kRows) {
        run_tile<T>(a, row, static_cast<int>(std::min<int64_t>(kRows, rows - row)), blk, v);
      }
    }
  });
}

#endif  // __AVX512F__

bool compiled_for(const at::ScalarType dtype) {
#ifdef __AVX512F__
  if (dtype == at::kFloat) return true;
#endif
#ifdef __AVX512BF16__
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

// x [T, in] (rows contiguous), packed as above for `out` outputs, bias [out] or
// undefined; returns [T, out] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(compiled_for(x.scalar_type()), "cpu_linear was not compiled for ", x.scalar_type(), " on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, in] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && packed.dim() == 2,
              "packed must be a contiguous [blocks, block_len] tensor of x's dtype");
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  const int64_t per_input = x.scalar_type() == at::kFloat ? in * kBlock : (in + 1) / 2 * 2 * kBlock;
  TORCH_CHECK(packed.size(0) == blocks && packed.size(1) == per_input, "packed weight does not match in=", in,
              " out=", out);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out,
                "bias must be a contiguous [out] tensor of x's dtype");
  }
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
#ifdef __AVX512F__
  AT_DISPATCH_SWITCH(x.scalar_type(), "cpu_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      run<float>({x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), per_input,
                  has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), out, in, out}, rows);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      run<T>({x.data_ptr<T>(), x.stride(0), packed.data_ptr<T>(), per_input,
              has_bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), out, in, out}, rows);
    }));
#endif
  return y;
}

std::vector<std::string> dtypes() {
  std::vector<std::string> names;
  if (compiled_for(at::kFloat)) names.emplace_back("float32");
  if (compiled_for(at::kBFloat16)) names.emplace_back("bfloat16");
  return names;
}

}  // namespace

TORCH_LIBRARY(agentkv_cpu_linear, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out) -> Tensor");
  m.def("dtypes() -> str[]", &dtypes);
}

TORCH_LIBRARY_IMPL(agentkv_cpu_linear, CPU, m) { m.impl("linear", &linear); }
