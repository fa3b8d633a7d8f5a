// CPU attention of a few queries per sequence (a decode step, a k+1 verify)
// over the paged KV pool, read in place: flash-decoding over each sequence's
// pages, every K/V page read once per step by all query heads of its KV head.
//
// Work items are (sequence, KV head, key split). A split is a fixed run of
// LOGICAL key positions [c * split, (c + 1) * split), whatever the batch or the
// thread count, and splits are merged in order: a sequence's result depends on
// its own keys only, not on where its pages lie or what shares its step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_attention.h"

namespace {

using namespace agentkv;

// Horizontal max and sum of a vector, and the levels of a transposing sum of
// kLanes vectors a[0..kLanes) into one whose lane i is the sum of a[i]'s
// lanes: kLanes horizontal sums in kLanes - 1 shuffle pairs, where one at a
// time would take kLanes log2(kLanes). tile_scores folds a tile's dot vectors
// as they are made, two at a time, so that few of them are live at once.
// Every level shuffles within 128-bit lanes or moves whole 128-bit lanes
// (unpck*ps, shufps, shuff32x4 or vperm2f128, one cycle each on Zen), never
// across lanes by index (vpermt2ps, which the natural interleave compiles to
// and which was much of the bf16 kernel's time): level 1 sums lanes
// (0, 2) and (1, 3) of each 128-bit lane, level 2 the two halves of that,
// the last levels the 128-bit lanes, and key i still lands in lane i.
#ifdef __AVX512F__
inline float hmax(vecf v) {
  v = v > __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) ? v : __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) ? v : __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) ? v : __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14) ? v : __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

inline float hsum(vecf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

inline vecf fold1(vecf a, vecf b) {  // (a0+a2, b0+b2, a1+a3, b1+b3) per 128-bit lane
  return __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
         __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
}
inline vecf fold2(vecf a, vecf b) {  // (a, b, c, d) per 128-bit lane from two fold1s
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
// 128-bit lanes (a0+a1, a2+a3, b0+b1, b2+b3), so that two levels of it give
// (sum a, sum b, sum c, sum d) from four fold2s.
inline vecf fold34(vecf a, vecf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
// The tile's scores from its four quads of keys, each folded by fold2.
inline vecf fold_quads(const vecf (&quad)[kLanes / 4]) {
  return fold34(fold34(quad[0], quad[1]), fold34(quad[2], quad[3]));
}
#else
inline float hmax(vecf v) {
  v = v > __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3) ? v : __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5) ? v : __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6) ? v : __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

inline float hsum(vecf v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

inline vecf fold1(vecf a, vecf b) {  // (a0+a2, b0+b2, a1+a3, b1+b3) per 128-bit lane
  return __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
}
inline vecf fold2(vecf a, vecf b) {  // (a, b, c, d) per 128-bit lane from two fold1s
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
// The tile's scores from its two quads of keys, each folded by fold2: the
// low 128-bit lanes plus the high ones.
inline vecf fold_quads(const vecf (&quad)[kLanes / 4]) {
  return __builtin_shufflevector(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

constexpr int64_t kMaxPrefetchTiles = 16;

inline int64_t acc_offset(int64_t rows) { return (2 * rows + kLanes - 1) / kLanes * kLanes; }

// Rows processed together: each key and value vector loaded from the tile is
// used by all of them, their queries and outputs stay in registers (at most
// 16 of each on AVX-512's 32; AVX2's 16 hold half as many).
template <int NV>
constexpr int kRowBlock = kLanes == 16 ? (NV <= 4 ? 4 : (NV <= 5 ? 3 : 2)) : (NV <= 4 ? 3 : (NV <= 8 ? 2 : 1));

struct TileMask {
  bool on;  // whether any lane of the tile is hidden from some row
  int64_t first_pos, group, start, n, window;
};

// The tile some tiles ahead when it lies in one page (keys at one stride):
// each key's lines are prefetched as the same key of this tile is read, so
// that the requests are spread over the tile rather than issued in a burst.
template <int64_t Bytes>  // of one key
struct Ahead {
  const char *k = nullptr, *v = nullptr;
  int64_t k_stride = 0, v_stride = 0;  // bytes between keys
  static void key(const char* base, int64_t stride, int i) {
    if (base == nullptr) return;
    for (int64_t b = 0; b < Bytes; b += 64) prefetch_l1(base + i * stride + b);
  }
  void k_key(int i) const { key(k, k_stride, i); }
  void v_key(int i) const { key(v, v_stride, i); }
};

// No software prefetch: the hardware prefetchers alone, which on some hosts
// of this CPU feed the kernel faster than they do with the prefetches beside
// them (kernels/cpu_paged_attention.py, choose_prefetch).
struct NoAhead {
  void k_key(int) const {}
  void v_key(int) const {}
};

// One score vector per row for the tile's kLanes keys: dot(i, d) writes key
// i's partial dot product vector for every row of the block into d, and the
// vectors are folded into transposed sums two keys at a time.
template <int RB, typename Dot>
inline void tile_scores(vecf (&s)[RB], Dot dot) {
  vecf l2[RB][kLanes / 4];
  for (int quad = 0; quad < kLanes / 4; ++quad) {
    vecf l1[RB][2];
    for (int pair = 0; pair < 2; ++pair) {
      vecf d0[RB], d1[RB];
      dot(4 * quad + 2 * pair, d0);
      dot(4 * quad + 2 * pair + 1, d1);
      for (int r = 0; r < RB; ++r) l1[r][pair] = fold1(d0[r], d1[r]);
    }
    for (int r = 0; r < RB; ++r) l2[r][quad] = fold2(l1[r][0], l1[r][1]);
  }
  for (int r = 0; r < RB; ++r) s[r] = fold_quads(l2[r]);
}

// The online-softmax update of one row by its tile of scores s: hides the
// masked lanes, rescales the row's outputs o and sum l when its max m grows,
// and returns exp(s - m) (all 0 when the row sees none of the tile).
template <int NV>
inline vecf tile_softmax(vecf s, int64_t row, const TileMask& mask, float& m, float& l, vecf* o) {
  if (mask.on) {
    const veci lane = lane_index();
    const int64_t pos = mask.first_pos + row / mask.group;
    const veci key = lane + int32_t(mask.start);
    veci visible = (key <= int32_t(pos)) & (lane < int32_t(mask.n));
    if (mask.window > 0) visible &= key > int32_t(pos - mask.window);
    s = visible ? s : splat(kNegInf);
  }
  const float mx = hmax(s);
  if (mx == kNegInf) return vecf{};
  if (mx > m) {
    const float alpha = exp_nonpositive(m - mx);  // 0 from -inf
    for (int w = 0; w < NV; ++w) o[w] *= alpha;
    l *= alpha;
    m = mx;
  }
  return exp_nonpositive(s - m);
}

// Rows [r0, r0 + RB) over one tile of kLanes keys and values, read (and
// converted to fp32) straight from their pages: scores, the online-softmax
// update of (m, l), and the outputs a. q is pre-scaled fp32.
template <typename T, int NV, int RB, typename Prefetch>
inline void tile_rows(const vecf* qf, const T* const* kp, const T* const* vp, vecf* a, float* m, float* l,
                      int64_t r0, const TileMask& mask, const Prefetch& ahead) {
  vecf q[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < NV; ++w) q[r][w] = qf[(r0 + r) * NV + w];
  vecf s[RB];
  tile_scores<RB>(s, [&](int i, vecf* d) {
    vecf kk[NV];
    for (int w = 0; w < NV; ++w) kk[w] = load_vec(kp[i] + w * kLanes);
    ahead.k_key(i);
    for (int r = 0; r < RB; ++r) {
      d[r] = q[r][0] * kk[0];
      for (int w = 1; w < NV; ++w) d[r] += q[r][w] * kk[w];
    }
  });
  vecf p[RB], o[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    for (int w = 0; w < NV; ++w) o[r][w] = a[row * NV + w];
    p[r] = tile_softmax<NV>(s[r], row, mask, m[row], l[row], o[r]);
    l[row] += hsum(p[r]);
  }
  for (int i = 0; i < kLanes; ++i) {
    vecf vv[NV];
    for (int w = 0; w < NV; ++w) vv[w] = load_vec(vp[i] + w * kLanes);
    ahead.v_key(i);
    for (int r = 0; r < RB; ++r) {
      const float pi = p[r][i];
      for (int w = 0; w < NV; ++w) o[r][w] += pi * vv[w];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < NV; ++w) a[(r0 + r) * NV + w] = o[r][w];
}

#ifdef __AVX512BF16__
// bf16 with head_dim a multiple of 32, on AVX512-BF16: vdpbf16ps multiplies
// pairs of bf16 exactly and sums them in fp32, so K and V are never widened.
// q.K takes the bf16 query as it is (scaled after, in fp32); p.V takes p
// rounded to bf16 as flash attention does on GPUs, with the row's sum l taken
// over the same rounded p, so the output stays a convex combination of V
// rows. The value rows of keys 2i and 2i+1 are interleaved into pairs by
// unpacklo/hi, which permute dimensions within each 128-bit lane: output
// vector 2w + h, lane 4 L + t holds dimension 32 w + 8 L + 4 h + t
// (dp_dim_slot, undone when the output is stored).
inline __m512i load_words(const uint16_t* p) { return _mm512_loadu_si512(p); }

template <int NV, int RB, typename Prefetch>
inline void tile_rows_dp(const __m512i* qw, const uint16_t* const* kp, const uint16_t* const* vp, vecf* a, float* m,
                         float* l, int64_t r0, const TileMask& mask, float scale, const Prefetch& ahead) {
  constexpr int NW = NV / 2;  // 32-element words per row
  __m512bh q[RB][NW];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < NW; ++w) q[r][w] = (__m512bh)qw[(r0 + r) * NW + w];
  vecf s[RB];
  tile_scores<RB>(s, [&](int i, vecf* d) {
    __m512bh kk[NW];
    for (int w = 0; w < NW; ++w) kk[w] = (__m512bh)load_words(kp[i] + w * 2 * kLanes);
    ahead.k_key(i);
    for (int r = 0; r < RB; ++r) {
      __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[r][0], kk[0]);
      for (int w = 1; w < NW; ++w) x = _mm512_dpbf16_ps(x, q[r][w], kk[w]);
      d[r] = (vecf)x;
    }
  });
  alignas(32) uint32_t pairs[RB][kLanes / 2];  // (p[2i], p[2i+1]) as bf16 pairs
  vecf o[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    for (int w = 0; w < NV; ++w) o[r][w] = a[row * NV + w];
    const vecf p = tile_softmax<NV>(s[r] * scale, row, mask, m[row], l[row], o[r]);
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh((__m512)p);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), pb);
    l[row] += hsum((vecf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16));
  }
  for (int i = 0; i < kLanes / 2; ++i) {
    __m512bh pp[RB];
    for (int r = 0; r < RB; ++r) pp[r] = (__m512bh)_mm512_set1_epi32(int32_t(pairs[r][i]));
    ahead.v_key(2 * i);
    ahead.v_key(2 * i + 1);
    for (int w = 0; w < NW; ++w) {
      const __m512i x = load_words(vp[2 * i] + w * 2 * kLanes), y = load_words(vp[2 * i + 1] + w * 2 * kLanes);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int r = 0; r < RB; ++r) {
        o[r][2 * w] = (vecf)_mm512_dpbf16_ps((__m512)o[r][2 * w], lo, pp[r]);
        o[r][2 * w + 1] = (vecf)_mm512_dpbf16_ps((__m512)o[r][2 * w + 1], hi, pp[r]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < NV; ++w) a[(r0 + r) * NV + w] = o[r][w];
}
#endif

// One work item: rows (query j, group head g) as r = j * G + g, over the keys
// [key_lo, key_hi) of one KV head, leaving its running max, sum and unnormalised
// output (m, l, acc[D]) per row in part. Keys go in tiles of kLanes logical
// positions (across pages when pages are smaller): per row, one vector of
// scores, one online-softmax update, kLanes value rows accumulated. Keys up to
// s_len (the next split's) are prefetched `ahead` tiles ahead when kPrefetch.
template <typename T, int NV, bool kPrefetch>
void attend_split(const T* q, int64_t q_token_stride, int64_t q_head_stride, const T* k, const T* v,
                  const Strides& ks, const Strides& vs, const int32_t* table, int64_t page_size, int64_t kv_head,
                  int64_t group, int64_t num_q, int64_t first_pos, int64_t window, int64_t key_lo, int64_t key_hi,
                  int64_t s_len, int64_t ahead_tiles, float scale, float* part, std::vector<vecf>& scratch) {
  constexpr int64_t D = NV * kLanes;
  constexpr bool dp = kDotBf16<T, NV>;
  const int64_t rows = group * num_q;
  scratch.resize(rows * NV);
  constexpr int RB = kRowBlock<NV>;
  float* m = part;  // part (64-byte aligned): [rows] max, [rows] sum, then at acc_offset [rows, D] acc
  float* l = part + rows;
  vecf* a = reinterpret_cast<vecf*>(part + acc_offset(rows));
  for (int64_t j = 0; j < num_q; ++j)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + j * q_token_stride + (kv_head * group + g) * q_head_stride;
      if constexpr (dp)  // [rows][NV / 2] bf16 words, as they are
        std::memcpy(scratch.data() + (j * group + g) * NV / 2, src, D * sizeof(T));
      else  // [rows][NV] scaled queries in fp32
        for (int w = 0; w < NV; ++w) scratch[(j * group + g) * NV + w] = load_vec(src + w * kLanes) * scale;
    }
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  for (int64_t i = 0; i < rows * NV; ++i) a[i] = vecf{};
  const int64_t last_pos = first_pos + num_q - 1;
  // A tile lies within one page when pages hold whole tiles (one table read
  // per tile); smaller pages are looked up per key.
  const bool one_page = page_size % kLanes == 0;
  using Prefetch = std::conditional_t<kPrefetch, Ahead<D * sizeof(T)>, NoAhead>;
  for (int64_t start = key_lo; start < key_hi; start += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, key_hi - start);
    const int64_t tile_page = one_page ? table[start / page_size] : 0, tile_slot = start % page_size;
    // Lanes past the tile's end read its first key: valid memory, masked.
    const T* kp[kLanes];
    const T* vp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      int64_t page = tile_page, slot = tile_slot + (i < n ? i : 0);
      if (!one_page) {
        page = table[(start + (i < n ? i : 0)) / page_size];
        slot = (start + (i < n ? i : 0)) % page_size;
      }
      kp[i] = k + page * ks.page + kv_head * ks.head + slot * ks.slot;
      vp[i] = v + page * vs.page + kv_head * vs.head + slot * vs.slot;
    }
    // The tile ahead_tiles ahead, so that its reads overlap this math where
    // the hardware prefetchers alone leave the loads stalled on memory.
    Prefetch ahead;
    if constexpr (kPrefetch) {
      const int64_t next = start + ahead_tiles * kLanes;
      if (one_page && next < s_len) {
        const int64_t page = table[next / page_size], slot = next % page_size;
        ahead = {reinterpret_cast<const char*>(k + page * ks.page + kv_head * ks.head + slot * ks.slot),
                 reinterpret_cast<const char*>(v + page * vs.page + kv_head * vs.head + slot * vs.slot),
                 int64_t(ks.slot * sizeof(T)), int64_t(vs.slot * sizeof(T))};
      } else {
        for (int64_t pos = next, end = std::min(s_len, next + kLanes); pos < end; ++pos) {
          const int64_t page = table[pos / page_size], slot = pos % page_size;
          Prefetch::key(reinterpret_cast<const char*>(k + page * ks.page + kv_head * ks.head + slot * ks.slot), 0, 0);
          Prefetch::key(reinterpret_cast<const char*>(v + page * vs.page + kv_head * vs.head + slot * vs.slot), 0, 0);
        }
      }
    }
    // Only a tile past the first query's position, reaching below the last
    // query's window, or cut short holds lanes some row must not see.
    const bool masked =
        start + kLanes - 1 > first_pos || (window > 0 && start <= last_pos - window) || n < kLanes;
    const TileMask mask{masked, first_pos, group, start, n, window};
    auto block = [&](auto rb, int64_t r) {
      constexpr int B = decltype(rb)::value;
#ifdef __AVX512BF16__
      if constexpr (dp) {
        tile_rows_dp<NV, B>(reinterpret_cast<const __m512i*>(scratch.data()), kp, vp, a, m, l, r, mask, scale, ahead);
        return;
      }
#endif
      if constexpr (!dp) tile_rows<T, NV, B>(scratch.data(), kp, vp, a, m, l, r, mask, ahead);
    };
    int64_t r = 0;
    for (; r + RB <= rows; r += RB) block(std::integral_constant<int, RB>{}, r);
    switch (rows - r) {  // the last, shorter block of rows
#define AGENTKV_ROWS(rb) \
  case rb:               \
    if constexpr (rb < RB) block(std::integral_constant<int, rb>{}, r); \
    break;
      AGENTKV_ROWS(1) AGENTKV_ROWS(2) AGENTKV_ROWS(3)
#undef AGENTKV_ROWS
    }
  }
}

template <typename T, int NV>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_q,
         const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, int64_t window,
         int64_t max_queries, int64_t split, int64_t prefetch, at::Tensor& out) {
  constexpr int64_t D = NV * kLanes;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = q.size(1) / num_kv_heads;
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const Strides ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const Strides vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};

  // Items in order (sequence, KV head, split); a window skips the splits
  // wholly before its first query's first key, and the tiles before that
  // key's within its split.
  struct Item {
    int64_t seq, head, key_lo, key_hi, part;
  };
  std::vector<Item> items;
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  int64_t part_floats = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    first_item[b] = items.size();
    const int64_t num_q = cu[b + 1] - cu[b], s_len = lens[b];
    TORCH_CHECK(num_q >= 1 && s_len >= num_q, "sequence ", b, ": bad lengths");
    if (num_q > max_queries) continue;
    const int64_t first_pos = s_len - num_q;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / kLanes * kLanes : 0;
    const int64_t rows = group * num_q;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t c = lo / split; c * split < s_len; ++c) {
        items.push_back({b, h, std::max(lo, c * split), std::min(s_len, (c + 1) * split), part_floats});
        part_floats += acc_offset(rows) + rows * D;
      }
  }
  first_item[num_seqs] = items.size();
  std::vector<vecf> part_vectors(part_floats / kLanes);
  float* parts = reinterpret_cast<float*>(part_vectors.data());

  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qt = q.stride(0), qh = q.stride(1), ot = out.stride(0), oh = out.stride(1);
  at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<vecf> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t num_q = cu[it.seq + 1] - cu[it.seq];
      auto attend = prefetch > 0 ? attend_split<T, NV, true> : attend_split<T, NV, false>;
      attend(qp + cu[it.seq] * qt, qt, qh, kp, vp, ks, vs, tables + it.seq * table_stride, page_size, it.head, group,
             num_q, lens[it.seq] - num_q, window, it.key_lo, it.key_hi, lens[it.seq], prefetch, float(scale),
             parts + it.part, scratch);
    }
  });

  // Merge each (sequence, KV head)'s splits in order. Every row sees at
  // least its own key, so its largest max is finite.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> ps;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;
      const int64_t num_q = cu[b + 1] - cu[b];
      if (num_q > max_queries) continue;
      const int64_t rows = group * num_q, head = acc_offset(rows);
      ps.clear();
      for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i)
        if (items[i].head == h) ps.push_back(parts + items[i].part);
      for (int64_t r = 0; r < rows; ++r) {
        float mx = kNegInf;
        for (const float* p : ps) mx = std::max(mx, p[r]);
        float total = 0.0f;
        vecf o[NV] = {};
        for (const float* p : ps) {
          const float w = exp_nonpositive(p[r] - mx);
          total += w * p[rows + r];
          const vecf* acc = reinterpret_cast<const vecf*>(p + head) + r * NV;
          for (int x = 0; x < NV; ++x) o[x] += w * acc[x];
        }
        const float inv = 1.0f / total;
        T* dst = op + (cu[b] + r / group) * ot + (h * group + r % group) * oh;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t slot = acc_slot<T, NV>(d);
          store(dst + d, o[slot / kLanes][slot % kLanes] * inv);
        }
      }
    }
  });
}

template <typename T>
void run_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_q,
             const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, int64_t window,
             int64_t max_queries, int64_t split, int64_t prefetch, at::Tensor& out) {
  switch (q.size(2) / kDimQuantum) {
#define AGENTKV_DIM(n) \
  case n:              \
    return run<T, n * kDimQuantum / kLanes>(q, k_cache, v_cache, cu_q, seq_lens, block_tables, scale, window, max_queries, split, prefetch, \
                      out);
    AGENTKV_DIM(1) AGENTKV_DIM(2) AGENTKV_DIM(3) AGENTKV_DIM(4) AGENTKV_DIM(5) AGENTKV_DIM(6) AGENTKV_DIM(7)
    AGENTKV_DIM(8)
#undef AGENTKV_DIM
  }
}

// Fills out's rows of every sequence with at most max_queries queries; the
// rows of longer ones are left to the caller. prefetch: tiles of kLanes keys read
// ahead by software prefetch, 0 for none (the result's bits are the same).
void paged_attention_few(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                         double scale, int64_t window, int64_t max_queries, int64_t split, int64_t prefetch,
                         at::Tensor out) {
  check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out);
  TORCH_CHECK(split > 0 && split % kDimQuantum == 0, "split must be a positive multiple of ", kDimQuantum);
  TORCH_CHECK(prefetch >= 0 && prefetch <= kMaxPrefetchTiles, "prefetch must be 0..", kMaxPrefetchTiles, " tiles");
  if (q.scalar_type() == at::kFloat)
    run_dim<float>(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, max_queries, split,
                   prefetch, out);
  else if (q.scalar_type() == at::kBFloat16)
    run_dim<uint16_t>(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window, max_queries, split,
                      prefetch, out);
  else
    TORCH_CHECK(false, "float32 or bfloat16 only, not ", q.scalar_type());
}

}  // namespace

AGENTKV_LIBRARY(agentkv_cpu, m) {
  m.def("paged_attention_few(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
        "Tensor block_tables, float scale, int window, int max_queries, int split, int prefetch, Tensor(a!) out) -> ()");
  m.impl("paged_attention_few", c10::DispatchKey::CPU, &paged_attention_few);
}
