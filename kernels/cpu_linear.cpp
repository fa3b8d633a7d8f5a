// CPU linear y = x @ W (+ b) for the model's weights, packed once into blocks
// of 16 outputs that the kernel streams front to back:
//   fp32: [out/16][in][16]          one FMA per input per 16 outputs
//   bf16: [out/16][ceil(in/2)][16][2] pairs of inputs, as vdpbf16ps takes them
// Work is split over output blocks (both cores busy at one row); each thread
// runs tiles of up to kRows rows x 4 blocks (bf16: 8 at 1-2 rows) over its blocks. No software
// prefetch: each tile reads 4 sequential streams, which the hardware
// prefetchers follow; _mm_prefetch 512 B - 4 KiB ahead measured no faster
// (docs/bench_cpu_linear.md).
//
// Two vector ISAs from the one source, chosen by the build's flags
// (kernels/cpu_extension.py builds one library per ISA): AVX-512, where a
// block of 16 outputs is one register and bf16 pairs go through vdpbf16ps
// (AVX512-BF16) or are widened to fp32; AVX2+FMA, where a block is two
// registers, bf16 is always widened (exact: a bf16 is the top half of an
// fp32) and the tiles are smaller to fit 16 registers.
//
// Bit invariance: every output element accumulates over `in` in the same
// order with the same instruction whatever the tile it falls in (a tile's
// rows and blocks only share loads), so a row's result does not depend on
// how many rows share the call or where it sits among them.
//
// AMX (built where the CPU has AMX-BF16 and Linux grants the tile state): a
// bf16 weight whose `in` is a multiple of 32 runs on the tile unit at every
// row count, one row as many (vdpbf16ps and tdpbf16ps sum a pair in another
// order, so one weight never mixes them). The packed block is already
// tdpbf16ps's B layout: 16 input pairs x 16 outputs per 1 KiB tile. Rows go
// 16 to a tile, a short last tile padded with zero rows in a buffer; each
// row's sums run over `in` in tile order whatever shares its tile, so the
// invariance above holds. Prefill chunks gain most (there oneDNN's AMX
// matmuls beat the vector kernel, docs/bench_cpu_linear.md),
// and a decode step stays bound by reading the weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_library.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>


namespace {

constexpr int64_t kBlock = 16;  // outputs per packed block: 16 fp32 lanes

#if defined(__AVX512F__)
#define AGENTKV_LINEAR_VECTORS 1
// The 16 fp32 outputs of one block in one register.
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes splat(float x) { return {_mm512_set1_ps(x)}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  // 16 (even, odd) bf16 input pairs widened: the even input is the low half
  // of each 32-bit pair, the odd one the high half.
  static void load_pairs(const uint16_t* p, Lanes& even, Lanes& odd) {
    const __m512i u = _mm512_loadu_si512(p);
    even.v = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    odd.v = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int32_t(0xffff0000u))));
  }
  void fma(const Lanes& x, const Lanes& w) { v = _mm512_fmadd_ps(x.v, w.v, v); }
  Lanes operator+(const Lanes& o) const { return {_mm512_add_ps(v, o.v)}; }
};

inline Lanes bias_lanes(const float* b, int64_t n) {
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), b)};
}
inline Lanes bias_lanes(const c10::BFloat16* b, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), b);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}

inline void store_lanes(float* dst, const Lanes& v, int64_t n) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), v.v);
}
// Round to nearest even as c10::BFloat16 (torch's .to(bfloat16)) does, NaN
// to 0x7fc0; vcvtneps2bf16 would flush denormals, which torch keeps.
inline void store_lanes(c10::BFloat16* dst, const Lanes& v, int64_t n) {
  const __m512i u = _mm512_castps_si512(v.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1), _mm512_cvtepi32_epi16(r));
}

// Rows x blocks per tile, per dtype: 6 x 4 accumulators + 4 weights + 1
// broadcast <= 32 registers. At up to kWideRows rows (a decode step's one
// row) bf16 tiles take 8 blocks: 8 streams in flight rather than 4, since
// at 4 one core fell short of a plain read of the weights; fp32, near it at
// 4, got slower at 8 (docs/bench_cpu_linear.md, rounds 2 and 3).
template <typename T> constexpr int kRows = 6;
template <typename T> constexpr int kVecs = 4;
template <typename T> constexpr int kWideVecs = std::is_same_v<T, float> ? 4 : 8;
constexpr int kWideRows = 2;

#elif defined(__AVX2__) && defined(__FMA__)
#define AGENTKV_LINEAR_VECTORS 1
// The 16 fp32 outputs of one block in two registers.
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes splat(float x) {
    const __m256 v = _mm256_set1_ps(x);
    return {v, v};
  }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void load_pairs(const uint16_t* p, Lanes& even, Lanes& odd) {
    const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))};
  }
  void fma(const Lanes& x, const Lanes& w) {
    lo = _mm256_fmadd_ps(x.lo, w.lo, lo);
    hi = _mm256_fmadd_ps(x.hi, w.hi, hi);
  }
  Lanes operator+(const Lanes& o) const { return {_mm256_add_ps(lo, o.lo), _mm256_add_ps(hi, o.hi)}; }
};

// A block's bias and its stores go through 16 floats in memory: they run
// once per output, against `in` FMAs each, and c10::BFloat16 rounds as torch.
template <typename T>
inline Lanes bias_lanes(const T* b, int64_t n) {
  alignas(32) float f[kBlock] = {};
  for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(b[i]);
  return Lanes::load(f);
}
template <typename T>
inline void store_lanes(T* dst, const Lanes& v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == kBlock) {
      _mm256_storeu_ps(dst, v.lo);
      _mm256_storeu_ps(dst + 8, v.hi);
      return;
    }
  }
  alignas(32) float f[kBlock];
  _mm256_store_ps(f, v.lo);
  _mm256_store_ps(f + 8, v.hi);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(f[i]);
}

// 16 ymm registers: fp32 6 rows x 1 block (12 accumulators, 2 weights, a
// broadcast), bf16 4 x 1 (its pairs widen to 4 weight registers and 2
// broadcasts); at one or two rows, 2 blocks.
template <typename T> constexpr int kRows = std::is_same_v<T, float> ? 6 : 4;
template <typename T> constexpr int kVecs = 1;
template <typename T> constexpr int kWideVecs = 2;
constexpr int kWideRows = 2;
#endif

#ifdef AGENTKV_LINEAR_VECTORS

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
inline void tile_fp32(const Args<float>& a, int64_t row, int64_t blk, Lanes (&acc)[R][V]) {
  const float* w[V];
  for (int v = 0; v < V; ++v) w[v] = a.w + (blk + v) * a.block_len;
  const float* x = a.x + row * a.ldx;
  for (int64_t k = 0; k < a.in; ++k) {
    Lanes wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Lanes::load(w[v] + k * kBlock);
    for (int r = 0; r < R; ++r) {
      const Lanes xb = Lanes::splat(x[r * a.ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v].fma(xb, wv[v]);
    }
  }
}

inline float bf16_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 widened to fp32, each input pair as two FMAs (even input, then odd):
// exact products, fp32 sums in input order, as the fp32 kernel.
template <int R, int V>
inline void tile_bf16_widened(const Args<c10::BFloat16>& a, int64_t row, int64_t blk, Lanes (&acc)[R][V]) {
  const uint16_t* w[V];
  for (int v = 0; v < V; ++v) w[v] = reinterpret_cast<const uint16_t*>(a.w + (blk + v) * a.block_len);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(a.x + row * a.ldx);
  const int64_t pairs = (a.in + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    Lanes even[V], odd[V];
    for (int v = 0; v < V; ++v) Lanes::load_pairs(w[v] + p * 2 * kBlock, even[v], odd[v]);
    const bool has_odd = 2 * p + 1 < a.in;  // the last input of an odd `in` pairs with the zero pad
    for (int r = 0; r < R; ++r) {
      const Lanes xe = Lanes::splat(bf16_float(x[r * a.ldx + 2 * p]));
      for (int v = 0; v < V; ++v) acc[r][v].fma(xe, even[v]);
      if (has_odd) {
        const Lanes xo = Lanes::splat(bf16_float(x[r * a.ldx + 2 * p + 1]));
        for (int v = 0; v < V; ++v) acc[r][v].fma(xo, odd[v]);
      }
    }
  }
}

#ifdef __AVX512BF16__
template <int R, int V>
inline void tile_bf16(const Args<c10::BFloat16>& a, int64_t row, int64_t blk, Lanes (&acc)[R][V]) {
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
      for (int v = 0; v < V; ++v) acc[r][v].v = _mm512_dpbf16_ps(acc[r][v].v, xb, wv[v]);
    }
  }
  if (a.in % 2) {  // the last input pairs with a zero (the packed weight's pad is zero too)
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w[v] + pairs * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * a.ldx + a.in - 1]));
      for (int v = 0; v < V; ++v) acc[r][v].v = _mm512_dpbf16_ps(acc[r][v].v, xb, wv[v]);
    }
  }
}
#endif

#ifdef AGENTKV_AMX
using agentkv::amx_configure;
using agentkv::amx_permitted;
constexpr int64_t kAmxRows = agentkv::kTileRows;  // rows per tile
constexpr int64_t kAmxPairs = 16;                 // input pairs per tile (64 bytes of a row)

// Row tile t of x (16 rows from row 16 t) and its stride in bytes; the short
// last one from pad, its rows followed by zero rows.
struct AmxRows {
  const uint16_t* x;
  int64_t ldx, full;  // full: whole tiles in x
  const uint16_t* pad;
  int64_t in;
  const uint16_t* tile(int64_t t, int64_t& stride) const {
    if (t < full) {
      stride = ldx * 2;
      return x + t * kAmxRows * ldx;
    }
    stride = in * 2;
    return pad;
  }
};

void amx_store(const Args<c10::BFloat16>& a, const float* sums, int64_t row, int64_t rows, int64_t blk) {
  const int64_t col = blk * kBlock;
  const int64_t n = std::min<int64_t>(kBlock, a.out - col);
  const Lanes b = a.bias ? bias_lanes(a.bias + col, n) : Lanes::zero();
  for (int64_t r = 0; r < kAmxRows && row + r < rows; ++r) {
    const Lanes acc = Lanes::load(sums + r * kBlock);
    store_lanes(a.y + (row + r) * a.ldy + col, a.bias ? acc + b : acc, n);
  }
}

void run_amx(const Args<c10::BFloat16>& a, int64_t rows) {
  const int64_t blocks = (a.out + kBlock - 1) / kBlock;
  const int64_t chunks = a.in / (2 * kAmxPairs);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(a.x);
  const int64_t full = rows / kAmxRows, tiles = (rows + kAmxRows - 1) / kAmxRows;
  std::vector<uint16_t> pad;
  if (full < tiles) {
    pad.assign(kAmxRows * a.in, 0);
    for (int64_t r = full * kAmxRows; r < rows; ++r)
      std::memcpy(pad.data() + (r - full * kAmxRows) * a.in, x + r * a.ldx, a.in * 2);
  }
  const AmxRows xs{x, a.ldx, full, pad.data(), a.in};
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    amx_configure();  // tiles 0-3 the sums of 2 row tiles x 2 blocks, 4-5 the rows, 6-7 the blocks' weights
    alignas(64) float sums[4][kAmxRows * kBlock];
    for (int64_t blk = b0; blk < b1; blk += 2) {
      const bool two = blk + 1 < b1;  // the second block's tile runs zeros when there is none
      const uint16_t* w0 = reinterpret_cast<const uint16_t*>(a.w + blk * a.block_len);
      const uint16_t* w1 = two ? w0 + a.block_len : w0;
      for (int64_t t = 0; t < tiles; t += 2) {
        const int64_t row = t * kAmxRows;
        int64_t s0, s1 = 0;
        const uint16_t* x0 = xs.tile(t, s0);
        const bool second = t + 1 < tiles;
        const uint16_t* x1 = second ? xs.tile(t + 1, s1) : x0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (second) {
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t k = c * 2 * kAmxPairs;  // input index
            _tile_loadd(4, x0 + k, s0);
            _tile_loadd(5, x1 + k, s1);
            _tile_loadd(6, w0 + k * kBlock, 64);
            _tile_loadd(7, w1 + k * kBlock, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        } else {  // one row tile (a decode step's): the same sums, half the tile work
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t k = c * 2 * kAmxPairs;
            _tile_loadd(4, x0 + k, s0);
            _tile_loadd(6, w0 + k * kBlock, 64);
            _tile_loadd(7, w1 + k * kBlock, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        amx_store(a, sums[0], row, rows, blk);
        if (two) amx_store(a, sums[1], row, rows, blk + 1);
        if (second) {
          amx_store(a, sums[2], row + kAmxRows, rows, blk);
          if (two) amx_store(a, sums[3], row + kAmxRows, rows, blk + 1);
        }
      }
    }
    _tile_release();
  });
}

bool amx_runs(const Args<c10::BFloat16>& a) { return a.in % (2 * kAmxPairs) == 0 && amx_permitted(); }
#endif

template <typename T, int R, int V>
void tile(const Args<T>& a, int64_t row, int64_t blk) {
  Lanes acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Lanes::zero();
  if constexpr (std::is_same_v<T, float>) {
    tile_fp32<R, V>(a, row, blk, acc);
  } else {
#ifdef __AVX512BF16__
    tile_bf16<R, V>(a, row, blk, acc);
#else
    tile_bf16_widened<R, V>(a, row, blk, acc);
#endif
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = (blk + v) * kBlock;
    const int64_t n = std::min<int64_t>(kBlock, a.out - col);
    const Lanes b = a.bias ? bias_lanes(a.bias + col, n) : Lanes::zero();
    for (int r = 0; r < R; ++r) {
      // The bias is added to the finished sum, as addmm does, then rounded once.
      store_lanes(a.y + (row + r) * a.ldy + col, a.bias ? acc[r][v] + b : acc[r][v], n);
    }
  }
}

template <typename T, int R>
void tile_rows(const Args<T>& a, int64_t row, int64_t blk, int v) {
  constexpr int most = R <= kWideRows ? std::max(kWideVecs<T>, kVecs<T>) : kVecs<T>;
  switch (v) {
    case 8: if constexpr (most >= 8) return tile<T, R, 8>(a, row, blk); break;
    case 7: if constexpr (most >= 7) return tile<T, R, 7>(a, row, blk); break;
    case 6: if constexpr (most >= 6) return tile<T, R, 6>(a, row, blk); break;
    case 5: if constexpr (most >= 5) return tile<T, R, 5>(a, row, blk); break;
    case 4: if constexpr (most >= 4) return tile<T, R, 4>(a, row, blk); break;
    case 3: if constexpr (most >= 3) return tile<T, R, 3>(a, row, blk); break;
    case 2: if constexpr (most >= 2) return tile<T, R, 2>(a, row, blk); break;
  }
  return tile<T, R, 1>(a, row, blk);
}

template <typename T>
void run_tile(const Args<T>& a, int64_t row, int r, int64_t blk, int v) {
  switch (r) {
    case 6: if constexpr (kRows<T> >= 6) return tile_rows<T, 6>(a, row, blk, v); break;
    case 5: if constexpr (kRows<T> >= 5) return tile_rows<T, 5>(a, row, blk, v); break;
    case 4: if constexpr (kRows<T> >= 4) return tile_rows<T, 4>(a, row, blk, v); break;
    case 3: return tile_rows<T, 3>(a, row, blk, v);
    case 2: return tile_rows<T, 2>(a, row, blk, v);
  }
  return tile_rows<T, 1>(a, row, blk, v);
}

template <typename T>
void run(const Args<T>& a, int64_t rows) {
#ifdef AGENTKV_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (amx_runs(a)) return run_amx(a, rows);
  }
#endif
  const int64_t blocks = (a.out + kBlock - 1) / kBlock;
  const int vecs = rows <= kWideRows ? kWideVecs<T> : kVecs<T>;
  // One chunk of blocks per thread: at a few rows the weights are the whole
  // cost, and each thread streams its share once.
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; blk += vecs) {
      const int v = static_cast<int>(std::min<int64_t>(vecs, b1 - blk));
      for (int64_t row = 0; row < rows; row += kRows<T>) {
        run_tile<T>(a, row, static_cast<int>(std::min<int64_t>(kRows<T>, rows - row)), blk, v);
      }
    }
  });
}

#endif  // AGENTKV_LINEAR_VECTORS

bool compiled_for(const at::ScalarType dtype) {
#ifdef AGENTKV_LINEAR_VECTORS
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return false;
#endif
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
#ifdef AGENTKV_LINEAR_VECTORS
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

// Whether a bf16 weight with `in` a multiple of 32 runs on the tile unit here.
bool amx() {
#ifdef AGENTKV_AMX
  return amx_permitted();
#else
  return false;
#endif
}

std::vector<std::string> dtypes() {
  std::vector<std::string> names;
  if (compiled_for(at::kFloat)) names.emplace_back("float32");
  if (compiled_for(at::kBFloat16)) names.emplace_back("bfloat16");
  return names;
}

}  // namespace

AGENTKV_LIBRARY(agentkv_cpu_linear, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out) -> Tensor");
  m.def("dtypes() -> str[]", &dtypes);
  m.def("amx() -> bool", &amx);
}

AGENTKV_LIBRARY_IMPL(agentkv_cpu_linear, m) { m.impl("linear", &linear); }
