// CPU attention of prompt chunks (many queries per sequence) over the paged
// KV pool, read in place: flash attention with register-tiled matmuls.
//
// Why not torch's CPU flash kernel (what the reference calls): its blocks run
// through cpublas, which reaches well below what this CPU's FMA units give
// (kernels/cpu_linear.cpp's tiles reach it), and prompt chunks are most of a
// long fp32 prefill's time (docs/bench_chunk_attention.md).
//
// Work items are (sequence, KV head, block of kRows rows), a row being one
// (query, query head of the group); the rows of a block share every K/V read.
// Per item: the block's queries transposed once into qt [D][kRows], then
// tiles of kTileKeys LOGICAL key positions, each:
//   scores S^T [keys][rows] = K qt, keys broadcast from their pages, kLanes rows
//     a vector (so the softmax of a row is a lane, and vertical);
//   the causal (and window) mask, the online-softmax update per lane;
//   O [rows][D] = alpha O + P V, probabilities broadcast, V rows from pages.
// Every row's arithmetic is its own, in key order, over tiles fixed by
// position: a row's result does not depend on the rows it shares a block
// with, the batch, or where its pages lie. A tile a row cannot see at all
// leaves it unchanged bit for bit (alpha = 1, p = 0), so which tiles an item
// skips does not matter either.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_library.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_attention.h"

namespace {

using namespace agentkv;

// The score tile takes kKeyBlock x kRowVecs accumulators, kRowVecs query
// loads and a key broadcast: 24 + 6 + 1 of AVX-512's 32 registers, 12 + 4 + 1
// of AVX2's 16 (one query load becomes an FMA's memory operand).
constexpr int kRowVecs = kLanes == 16 ? 6 : 4;   // row vectors per block
constexpr int64_t kRows = kRowVecs * kLanes;     // rows per item: 96 (32) = 32 (about 11) queries of a group of 3
constexpr int64_t kTileKeys = 64;                // keys per tile: S^T is 24 KB (8 KB), in L1 with the V rows
constexpr int kKeyBlock = kLanes == 16 ? 4 : 3;  // keys per score tile

// Scores of KB keys for all kRows rows, s[i][r] = k_i . qt[:, r], and their
// running max per row vector (the softmax pass then skips a read of the
// tile where nothing is masked).
template <int NV, int KB>
inline void score_keys(const float* qt, const float* const* krow, float* s, vecf* tmax) {
  constexpr int64_t D = NV * kLanes;
  vecf acc[KB][kRowVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    vecf qv[kRowVecs];
    for (int w = 0; w < kRowVecs; ++w) qv[w] = load_vec(qt + d * kRows + w * kLanes);
    for (int i = 0; i < KB; ++i) {
      const vecf kb = splat(krow[i][d]);
      for (int w = 0; w < kRowVecs; ++w) acc[i][w] += kb * qv[w];
    }
  }
  for (int i = 0; i < KB; ++i)
    for (int w = 0; w < kRowVecs; ++w) {
      store_vec(s + i * kRows + w * kLanes, acc[i][w]);
      tmax[w] = tmax[w] > acc[i][w] ? tmax[w] : acc[i][w];
    }
}

// Rows per P V tile: RB x NV accumulators, at most 24 registers on AVX-512,
// 12 on AVX2 (the value loads then come as FMA memory operands); RB divides
// kRows.
template <int NV>
constexpr int kPvRows = kLanes == 16 ? (NV <= 4 ? 6 : (NV <= 6 ? 4 : 3)) : (NV <= 3 ? 4 : (NV <= 6 ? 2 : 1));

// o[r] = alpha[r] o[r] + sum over the tile's n keys of p[j][r] v_j, rows [r0, r0 + RB).
template <int NV, int RB>
inline void accumulate_values(const float* p, const float* const* vrow, int64_t n, const float* alpha, float* o,
                              int64_t r0) {
  constexpr int64_t D = NV * kLanes;
  vecf acc[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int w = 0; w < NV; ++w) acc[i][w] = load_vec(o + (r0 + i) * D + w * kLanes) * alpha[r0 + i];
  for (int64_t j = 0; j < n; ++j) {
    vecf vv[NV];
    for (int w = 0; w < NV; ++w) vv[w] = load_vec(vrow[j] + w * kLanes);
    for (int i = 0; i < RB; ++i) {
      const vecf pb = splat(p[j * kRows + r0 + i]);
      for (int w = 0; w < NV; ++w) acc[i][w] += pb * vv[w];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int w = 0; w < NV; ++w) store_vec(o + (r0 + i) * D + w * kLanes, acc[i][w]);
}

#ifdef __AVX512BF16__
// bf16 with head_dim a multiple of 32, on AVX512-BF16: vdpbf16ps multiplies
// pairs of bf16 exactly and sums them in fp32, so K and V are never widened,
// as in the decode kernel. Scores take the queries as they are, pairs of
// dimensions [D/2][kRows] (scaled after, in fp32); P V takes p rounded to
// bf16, pairs of keys [keys/2][kRows], with each row's sum over the same
// rounded p. Value rows of keys 2i and 2i+1 are interleaved by unpacklo/hi,
// which permute dimensions within 128-bit lanes: dp_dim_slot says where
// dimension d lands (kernels/cpu_attention.h), undone when a row is stored.

inline __m512bh pair_splat(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return (__m512bh)_mm512_set1_epi32(x);
}

template <int NV, int KB>
inline void score_keys_dp(const uint32_t* qw, const uint16_t* const* krow, float scale, float* s, vecf* tmax) {
  constexpr int64_t kPairs = NV * kLanes / 2;
  __m512 acc[KB][kRowVecs];
  for (int i = 0; i < KB; ++i)
    for (int w = 0; w < kRowVecs; ++w) acc[i][w] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kPairs; ++d) {
    __m512bh qv[kRowVecs];
    for (int w = 0; w < kRowVecs; ++w) qv[w] = (__m512bh)_mm512_loadu_si512(qw + d * kRows + w * kLanes);
    for (int i = 0; i < KB; ++i) {
      const __m512bh kb = pair_splat(krow[i] + 2 * d);
      for (int w = 0; w < kRowVecs; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], qv[w], kb);
    }
  }
  for (int i = 0; i < KB; ++i)
    for (int w = 0; w < kRowVecs; ++w) {
      const vecf x = (vecf)acc[i][w] * scale;
      store_vec(s + i * kRows + w * kLanes, x);
      tmax[w] = tmax[w] > x ? tmax[w] : x;
    }
}

// Keys 2i and 2i+1's value rows as NV vectors of pairs (a missing second key
// as zeros: its p is 0, and 0 times a stray NaN would not be).
template <int NV>
inline void pack_value_pairs(const uint16_t* const* vrow, int64_t n, __m512i* pairs) {
  for (int64_t i = 0; 2 * i < n; ++i)
    for (int w = 0; w < NV / 2; ++w) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * i] + w * 2 * kLanes);
      const __m512i y = 2 * i + 1 < n ? _mm512_loadu_si512(vrow[2 * i + 1] + w * 2 * kLanes) : _mm512_setzero_si512();
      pairs[i * NV + 2 * w] = _mm512_unpacklo_epi16(x, y);
      pairs[i * NV + 2 * w + 1] = _mm512_unpackhi_epi16(x, y);
    }
}

// p rounded to bf16, keys j and j + 1 as one pair per row lane; returns the
// rounded values' sum. The exp of such a p needs no more than degree 4: a
// higher degree spends a bf16 tile's time on bits the rounding drops.
inline vecf pack_probability_pair(vecf e0, vecf e1, uint32_t* dst) {
  const __m512i u0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)e0));
  const __m512i u1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)e1));
  _mm512_storeu_si512(dst, _mm512_or_si512(u0, _mm512_slli_epi32(u1, 16)));
  return (vecf)_mm512_slli_epi32(u0, 16) + (vecf)_mm512_slli_epi32(u1, 16);
}

template <int NV, int RB>
inline void accumulate_values_dp(const uint32_t* pp, const __m512i* pairs, int64_t n, const float* alpha, float* o,
                                 int64_t r0) {
  constexpr int64_t D = NV * kLanes;
  __m512 acc[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int w = 0; w < NV; ++w)
      acc[i][w] = _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + i) * D + w * kLanes), _mm512_set1_ps(alpha[r0 + i]));
  for (int64_t j = 0; 2 * j < n; ++j) {
    __m512bh vv[NV];
    for (int w = 0; w < NV; ++w) vv[w] = (__m512bh)pairs[j * NV + w];
    for (int i = 0; i < RB; ++i) {
      const __m512bh pb = pair_splat(pp + j * kRows + r0 + i);
      for (int w = 0; w < NV; ++w) acc[i][w] = _mm512_dpbf16_ps(acc[i][w], vv[w], pb);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int w = 0; w < NV; ++w) _mm512_storeu_ps(o + (r0 + i) * D + w * kLanes, acc[i][w]);
}
#endif

struct Item {
  int64_t seq, head, row0, cost;
};

struct Geometry {
  int64_t page_size, group, window;
  Strides ks, vs;
};

#ifdef AGENTKV_AMX
// AMX, where it runs (bf16, head_dim a multiple of 32, pages a multiple of
// 16 keys): both matmuls of a tile on the tile unit, the softmax as above.
// Scores S^T [16 keys][16 rows] = K Q^T take 16 keys' rows straight from
// their page as A (a block of 16 never crosses a page) and the query pairs
// [D/2][kRows] as B; P V is computed transposed, O^T [16 dims][16 rows] =
// V^T P^T, so that p pairs [keys/2][kRows] are B as the softmax writes them
// and O^T's rows are vectors over rows, which alpha scales lane by lane. V^T
// is the value pairs (keys 2i, 2i + 1 interleaved) transposed as 32-bit
// words, once per tile for all rows. tdpbf16ps sums pairs in another order
// than vdpbf16ps, but each row's sums still run in key order over tiles
// fixed by position: a row's result depends on its own keys only.
// Tiles: 0 a sum, 1-2 B, 3-6 A.

// The score tile's A operands (tiles 3-6: a key block's rows, 32 dims a
// slice) and its sum over N slices, B in tiles 1 and 2 by turns. Tile
// numbers are the instructions' immediates: one line per slice.
template <int N>
inline void load_key_slices(const uint16_t* kp, int64_t stride) {
  static_assert(N >= 1 && N <= 4, "head_dim 32 to 128");
  _tile_loadd(3, kp, stride);
  if constexpr (N > 1) _tile_loadd(4, kp + 32, stride);
  if constexpr (N > 2) _tile_loadd(5, kp + 64, stride);
  if constexpr (N > 3) _tile_loadd(6, kp + 96, stride);
}

template <int N>
inline void dot_key_slices(const uint32_t* qw, int64_t r0) {
  constexpr int64_t stride = kRows * 4, slice = 16 * kRows;  // query pairs of 32 dims
  _tile_loadd(1, qw + r0, stride);
  _tile_dpbf16ps(0, 3, 1);
  if constexpr (N > 1) {
    _tile_loadd(2, qw + slice + r0, stride);
    _tile_dpbf16ps(0, 4, 2);
  }
  if constexpr (N > 2) {
    _tile_loadd(1, qw + 2 * slice + r0, stride);
    _tile_dpbf16ps(0, 5, 1);
  }
  if constexpr (N > 3) {
    _tile_loadd(2, qw + 3 * slice + r0, stride);
    _tile_dpbf16ps(0, 6, 2);
  }
}

// Unscaled scores of the tile's keys [start, start + n) into s [keys][kRows],
// 16 keys at a time; those past n are whatever the page holds, never read.
template <int NV>
inline void score_tile_amx(const uint32_t* qw, const uint16_t* k, const int32_t* table, const Geometry& g,
                           int64_t head, int64_t start, int64_t n, float* s) {
  for (int64_t j = 0; j < n; j += kTileRows) {
    const int64_t key = start + j;
    load_key_slices<NV / 2>(k + table[key / g.page_size] * g.ks.page + head * g.ks.head +
                                   key % g.page_size * g.ks.slot,
                               g.ks.slot * 2);
    for (int64_t r0 = 0; r0 < kRows; r0 += kTileRows) {
      _tile_zero(0);
      dot_key_slices<NV / 2>(qw, r0);
      _tile_stored(0, s + j * kRows + r0, kRows * 4);
    }
  }
}

// 16 rows of 16 32-bit words, stride vectors apart, transposed into dst [16][16].
inline void transpose_words(const __m512i* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4 i + c], 128-bit lane L: column 4 L + c of rows 4 i .. 4 i + 3
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), y = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_si512(dst + c * 16, _mm512_shuffle_i32x4(a, x, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * 16, _mm512_shuffle_i32x4(a, x, 0xDD));
    _mm512_storeu_si512(dst + (4 + c) * 16, _mm512_shuffle_i32x4(b, y, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * 16, _mm512_shuffle_i32x4(b, y, 0xDD));
  }
}

// ot [D slots][kRows] = alpha ot + V^T P^T over the tile's keys, in blocks of
// 32 (pairs and pp hold zeros past the tile's n keys up to the block's end).
template <int NV>
inline void accumulate_values_amx(const uint32_t* pp, const __m512i* pairs, int64_t blocks, const float* alpha,
                                  float* ot, uint32_t* vt, float* sum) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int w = 0; w < NV; ++w) transpose_words(pairs + b * 16 * NV + w, NV, vt + (b * NV + w) * 256);
  for (int64_t r0 = 0; r0 < kRows; r0 += kTileRows) {
    _tile_loadd(1, pp + r0, kRows * 4);
    if (blocks > 1) _tile_loadd(2, pp + 16 * kRows + r0, kRows * 4);
    const vecf a = load_vec(alpha + r0);
    for (int w = 0; w < NV; ++w) {
      _tile_zero(0);
      _tile_loadd(3, vt + w * 256, 64);
      _tile_dpbf16ps(0, 3, 1);
      if (blocks > 1) {
        _tile_loadd(4, vt + (NV + w) * 256, 64);
        _tile_dpbf16ps(0, 4, 2);
      }
      _tile_stored(0, sum, 64);
      for (int i = 0; i < 16; ++i) {
        float* row = ot + (w * 16 + i) * kRows + r0;
        store_vec(row, load_vec(row) * a + load_vec(sum + i * 16));
      }
    }
  }
}
#endif

// One thread's buffers, 64-byte aligned (vecf).
template <int NV>
struct Scratch {
  static constexpr int64_t D = NV * kLanes;
  std::vector<vecf> qt = std::vector<vecf>(D * kRowVecs);             // [D][kRows] scaled queries
  std::vector<vecf> s = std::vector<vecf>(kTileKeys * kRowVecs);      // [keys][kRows] scores, then p
  std::vector<vecf> o = std::vector<vecf>(kRows * NV);                // [kRows][D] unnormalised outputs
  std::vector<vecf> kv = std::vector<vecf>(2 * kTileKeys * NV);       // bf16 K and V rows widened, or V pairs
  std::vector<vecf> pp = std::vector<vecf>(kTileKeys / 2 * kRowVecs); // [keys/2][kRows] bf16 p pairs
  std::vector<vecf> vt = std::vector<vecf>(kTileKeys / 2 * NV);        // AMX: V^T, 16 x 16 words per 32 keys and slot vector
  std::vector<vecf> sum = std::vector<vecf>(16 * 16 / kLanes);          // AMX: one tile of sums
  float* f(std::vector<vecf>& v) { return reinterpret_cast<float*>(v.data()); }
};

// One item: rows [row0, row0 + kRows) of one (sequence, KV head), written
// to out normalised.
template <typename T, int NV>
void attend_block(const T* q, int64_t qt_stride, int64_t qh_stride, const T* k, const T* v, const int32_t* table,
                  const Geometry& g, int64_t head, int64_t num_q, int64_t s_len, int64_t row0, float scale, T* out,
                  int64_t ot_stride, int64_t oh_stride, bool amx, Scratch<NV>& buf) {
  constexpr int64_t D = NV * kLanes;
  constexpr bool dp = kDotBf16<T, NV>;
  const int64_t rows = std::min(kRows, num_q * g.group - row0);
  const int64_t first_pos = s_len - num_q;
  float* qt = buf.f(buf.qt);
  float* s = buf.f(buf.s);
  float* o = buf.f(buf.o);
  // Rows past the sequence's last one repeat it (their results are not stored).
  alignas(64) int32_t pos[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = row0 + std::min(r, rows - 1);
    pos[r] = int32_t(first_pos + row / g.group);
    const T* src = q + (row / g.group) * qt_stride + (head * g.group + row % g.group) * qh_stride;
    if constexpr (dp) {  // [D/2][kRows] pairs of dimensions, as they are
      uint32_t* qw = reinterpret_cast<uint32_t*>(qt);
      for (int64_t d = 0; d < D / 2; ++d) std::memcpy(qw + d * kRows + r, src + 2 * d, 4);
    } else {  // [D][kRows] scaled fp32
      for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = to_float(src[d]) * scale;
    }
  }
  std::fill(o, o + kRows * D, 0.0f);
  vecf m[kRowVecs], l[kRowVecs];
  for (int w = 0; w < kRowVecs; ++w) m[w] = splat(kNegInf), l[w] = vecf{};
  const int64_t lo_pos = pos[0], hi_pos = pos[kRows - 1];
  const int64_t key_lo = g.window > 0 ? std::max<int64_t>(0, lo_pos - g.window + 1) / kTileKeys * kTileKeys : 0;
  using Row = std::conditional_t<dp, uint16_t, float>;  // what the score and value loops read
  const Row* krow[kTileKeys];
  const Row* vrow[kTileKeys];
  alignas(64) float alpha[kRows];
  for (int64_t start = key_lo; start <= hi_pos; start += kTileKeys) {
    const int64_t n = std::min<int64_t>(kTileKeys, hi_pos + 1 - start);
    for (int64_t j = 0; j < n;) {  // a page's keys at a time: one table read each
      const int64_t key = start + j;
      const int64_t page = table[key / g.page_size], slot = key % g.page_size;
      const T* kp = k + page * g.ks.page + head * g.ks.head + slot * g.ks.slot;
      const T* vp = v + page * g.vs.page + head * g.vs.head + slot * g.vs.slot;
      for (const int64_t end = j + std::min(n - j, g.page_size - slot); j < end; ++j, kp += g.ks.slot, vp += g.vs.slot) {
        if constexpr (std::is_same_v<T, Row>) {
          krow[j] = kp, vrow[j] = vp;
        } else {  // bf16 of a head_dim vdpbf16ps does not take, or without it: widened
          float* kf = buf.f(buf.kv) + j * D;
          float* vf = kf + kTileKeys * D;
          for (int w = 0; w < NV; ++w) {
            store_vec(kf + w * kLanes, load_vec(kp + w * kLanes));
            store_vec(vf + w * kLanes, load_vec(vp + w * kLanes));
          }
          krow[j] = kf, vrow[j] = vf;
        }
      }
    }
    // The next tile's rows, toward L2 while this one computes: a tile spans
    // four pages, each where the hardware prefetchers must start over.
    for (int64_t key = start + kTileKeys, end = std::min(hi_pos + 1, start + 2 * kTileKeys); key < end;) {
      const int64_t page = table[key / g.page_size], slot = key % g.page_size;
      const T* kp = k + page * g.ks.page + head * g.ks.head + slot * g.ks.slot;
      const T* vp = v + page * g.vs.page + head * g.vs.head + slot * g.vs.slot;
      for (const int64_t stop = key + std::min(end - key, g.page_size - slot); key < stop;
           ++key, kp += g.ks.slot, vp += g.vs.slot)
        for (int64_t b = 0; b < int64_t(D * sizeof(T)); b += 64)
          prefetch_l2(reinterpret_cast<const char*>(kp) + b), prefetch_l2(reinterpret_cast<const char*>(vp) + b);
    }
    vecf tmax[kRowVecs];
    for (int w = 0; w < kRowVecs; ++w) tmax[w] = splat(kNegInf);
#ifdef AGENTKV_AMX
    if constexpr (dp) {
      if (amx) {
        score_tile_amx<NV>(reinterpret_cast<const uint32_t*>(qt), k, table, g, head, start, n, s);
        for (int64_t jj = 0; jj < n; ++jj)
          for (int w = 0; w < kRowVecs; ++w) {
            const vecf x = load_vec(s + jj * kRows + w * kLanes) * scale;
            store_vec(s + jj * kRows + w * kLanes, x);
            tmax[w] = tmax[w] > x ? tmax[w] : x;
          }
      }
    }
#endif
    auto score = [&](auto kb, int64_t j) {
      constexpr int KB = decltype(kb)::value;
#ifdef __AVX512BF16__
      if constexpr (dp) {
        score_keys_dp<NV, KB>(reinterpret_cast<const uint32_t*>(qt), krow + j, scale, s + j * kRows, tmax);
        return;
      }
#endif
      if constexpr (!dp) score_keys<NV, KB>(qt, krow + j, s + j * kRows, tmax);
    };
    int64_t j = amx ? n : 0;
    for (; j + kKeyBlock <= n; j += kKeyBlock) score(std::integral_constant<int, kKeyBlock>{}, j);
    switch (n - j) {
      case 1: score(std::integral_constant<int, 1>{}, j); break;
      case 2: score(std::integral_constant<int, 2>{}, j); break;
      case 3: if constexpr (kKeyBlock > 3) score(std::integral_constant<int, 3>{}, j); break;
    }
    // Only a tile reaching past the first row's position, or below the last
    // row's window, hides keys from some row.
    const bool masked = start + n - 1 > lo_pos || (g.window > 0 && start <= hi_pos - g.window);
    for (int w = 0; w < kRowVecs; ++w) {
      veci p;
      std::memcpy(&p, pos + w * kLanes, sizeof p);
      vecf mx = m[w];
      if (masked) {
        for (int64_t jj = 0; jj < n; ++jj) {
          const int32_t key = int32_t(start + jj);
          veci visible = (veci{} + key) <= p;
          if (g.window > 0) visible &= (veci{} + key) > p - int32_t(g.window);
          const vecf x = visible ? load_vec(s + jj * kRows + w * kLanes) : splat(kNegInf);
          store_vec(s + jj * kRows + w * kLanes, x);
          mx = mx > x ? mx : x;
        }
      } else {
        mx = mx > tmax[w] ? mx : tmax[w];
      }
      // A lane that has seen no key yet keeps max -inf: subtract 0 instead,
      // so that its p are exp(-inf) = 0 and its alpha exp(-inf) = 0.
      const vecf base = mx == splat(kNegInf) ? vecf{} : mx;
      const vecf a = exp_nonpositive(m[w] - base);
      vecf sum = vecf{};
#ifdef __AVX512BF16__
      if constexpr (dp) {
        uint32_t* pp = reinterpret_cast<uint32_t*>(buf.pp.data());
        for (int64_t jj = 0; jj < n; jj += 2) {
          const vecf e0 = exp_nonpositive<4>(load_vec(s + jj * kRows + w * kLanes) - base);
          const vecf e1 = jj + 1 < n ? exp_nonpositive<4>(load_vec(s + (jj + 1) * kRows + w * kLanes) - base) : vecf{};
          sum += pack_probability_pair(e0, e1, pp + jj / 2 * kRows + w * kLanes);
        }
      }
#endif
      if constexpr (!dp)
        for (int64_t jj = 0; jj < n; ++jj) {
          const vecf e = exp_nonpositive(load_vec(s + jj * kRows + w * kLanes) - base);
          store_vec(s + jj * kRows + w * kLanes, e);
          sum += e;
        }
      l[w] = l[w] * a + sum;
      m[w] = mx;
      store_vec(alpha + w * kLanes, a);
    }
    constexpr int RB = kPvRows<NV>;
    static_assert(kRows % RB == 0, "row blocks divide the item");
#ifdef __AVX512BF16__
    if constexpr (dp) {
      __m512i* pairs = reinterpret_cast<__m512i*>(buf.kv.data());
      pack_value_pairs<NV>(vrow, n, pairs);
      uint32_t* pp = reinterpret_cast<uint32_t*>(buf.pp.data());
#ifdef AGENTKV_AMX
      if (amx) {
        // The last block's pairs past the tile's keys: zeros, so that their products are (0 p for 0 v).
        const int64_t blocks = (n + 31) / 32, used = (n + 1) / 2;
        std::fill(pairs + used * NV, pairs + blocks * 16 * NV, _mm512_setzero_si512());
        std::fill(pp + used * kRows, pp + blocks * 16 * kRows, 0u);
        accumulate_values_amx<NV>(pp, pairs, blocks, alpha, o, reinterpret_cast<uint32_t*>(buf.vt.data()),
                                  buf.f(buf.sum));
      }
#endif
      if (!amx)
        for (int64_t r = 0; r < kRows; r += RB) accumulate_values_dp<NV, RB>(pp, pairs, n, alpha, o, r);
    }
#endif
    if constexpr (!dp)
      for (int64_t r = 0; r < kRows; r += RB) accumulate_values<NV, RB>(s, vrow, n, alpha, o, r);
  }
  alignas(64) float inv[kRows];
  for (int w = 0; w < kRowVecs; ++w) store_vec(inv + w * kLanes, 1.0f / l[w]);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row0 + r;
    T* dst = out + (row / g.group) * ot_stride + (head * g.group + row % g.group) * oh_stride;
    if (amx)  // O^T [slots][kRows]
      for (int64_t d = 0; d < D; ++d) store(dst + d, o[acc_slot<T, NV>(d) * kRows + r] * inv[r]);
    else
      for (int64_t d = 0; d < D; ++d) store(dst + d, o[r * D + acc_slot<T, NV>(d)] * inv[r]);
  }
}

template <typename T, int NV>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_q,
         const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, int64_t window,
         int64_t longer_than, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_kv_heads = k_cache.size(2);
  const Geometry g{k_cache.size(1), q.size(1) / num_kv_heads, window,
                   {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
                   {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}};
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t num_q = cu[b + 1] - cu[b], s_len = lens[b];
    TORCH_CHECK(num_q >= 1 && s_len >= num_q, "sequence ", b, ": bad lengths");
    if (num_q <= longer_than) continue;
    const int64_t rows = num_q * g.group;
    for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
      const int64_t last = s_len - num_q + std::min(rows, row0 + kRows) / g.group;
      const int64_t first = window > 0 ? std::max<int64_t>(0, s_len - num_q + row0 / g.group - window) : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({b, h, row0, last - first});
    }
  }
  // By head, so that the threads read the same K/V at once (two heads of
  // 16k keys overflow the L3), and within a head the longest first, taken by
  // whichever thread is free: the blocks of a fresh chunk differ in cost up
  // to its length over kRows.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.seq != b.seq ? a.seq < b.seq : (a.head != b.head ? a.head < b.head : a.cost > b.cost);
  });
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qts = q.stride(0), qhs = q.stride(1), ots = out.stride(0), ohs = out.stride(1);
#ifdef AGENTKV_AMX
  const bool amx = kDotBf16<T, NV> && g.page_size % kTileRows == 0 && amx_permitted();
#else
  const bool amx = false;
#endif
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch<NV> buf;
#ifdef AGENTKV_AMX
    if (amx) amx_configure();
#endif
    for (int64_t i = next++; i < int64_t(items.size()); i = next++) {
      const Item& it = items[i];
      const int64_t num_q = cu[it.seq + 1] - cu[it.seq];
      attend_block<T, NV>(qp + cu[it.seq] * qts, qts, qhs, kp, vp, tables + it.seq * block_tables.stride(0), g,
                          it.head, num_q, lens[it.seq], it.row0, float(scale), op + cu[it.seq] * ots, ots, ohs, amx,
                          buf);
    }
#ifdef AGENTKV_AMX
    if (amx) _tile_release();
#endif
    (void)begin, (void)end;
  });
}

template <typename T>
void run_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_q,
             const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, int64_t window,
             int64_t longer_than, at::Tensor& out) {
  switch (q.size(2) / kDimQuantum) {
#define AGENTKV_DIM(n) \
  case n:              \
    return run<T, n * kDimQuantum / kLanes>(q, k_cache, v_cache, cu_q, seq_lens, block_tables, scale, window, longer_than, out);
    AGENTKV_DIM(1) AGENTKV_DIM(2) AGENTKV_DIM(3) AGENTKV_DIM(4) AGENTKV_DIM(5) AGENTKV_DIM(6) AGENTKV_DIM(7)
    AGENTKV_DIM(8)
#undef AGENTKV_DIM
  }
}

// Fills out's rows of every sequence with more than longer_than queries; the
// rows of shorter ones are left to the caller.
void chunk_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t window, int64_t longer_than, at::Tensor out) {
  check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out);
  if (q.scalar_type() == at::kFloat)
    run_dim<float>(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, longer_than, out);
  else  // bf16 (checked)
    run_dim<uint16_t>(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, longer_than, out);
}

}  // namespace

AGENTKV_LIBRARY(agentkv_cpu_chunk, m) {
  m.def("chunk_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
        "Tensor block_tables, float scale, int window, int longer_than, Tensor(a!) out) -> ()");
  m.impl("chunk_attention", c10::DispatchKey::CPU, &chunk_attention);
}
