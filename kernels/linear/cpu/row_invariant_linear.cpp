// Row-invariant bf16 linear and batched matmul for CPUs (one translation unit, built on first use by
// expertmesh/kernels/linear/cpu_kernel.py with torch.utils.cpp_extension.load).
//
//     linear: y[m, n]    = round_bf16(sum_k x[m, k] * w[n, k])        w prepacked (layout below)
//     bmm:    y[b, m, n] = round_bf16(sum_k x[b, m, k] * w[b, k, n])  w read where it is ([K, N] rows, unit N stride)
//
// The reduction order of every output element is fixed and depends only on K: one fp32 accumulator, starting at
// +0, takes the element pairs (2p, 2p + 1) for p = 0, 1, ..., K/2 - 1 in order, the ODD element first:
//     acc = acc + x[2p+1] * w[2p+1];  acc = acc + x[2p] * w[2p]
// and, when K is odd, one last pair (K - 1, padding 0): acc = acc + 0 * 0; acc = acc + x[K-1] * w[K-1].
// The result is rounded to bf16 once (round to nearest even, NaN -> 0x7FC0, as c10::BFloat16). A product of two
// bf16 values is exact in fp32 (8 + 8 significant bits), so each step is one fp32 rounding. That is exactly what
// AVX512-BF16's VDPBF16PS does per fp32 lane (checked bitwise on this project's CPU: odd element first, then
// even, each added with its own rounding), so the fast path runs one VDPBF16PS per pair and 16 output columns;
// the portable loop runs the same steps one element at a time. Nothing in it depends on M, the row's position,
// the tiling (rows per tile, columns per group) or the thread count (threads split output column groups and row
// chunks, never K), so a row's result is bitwise the same in any batch.
//
// A third path, AMX-BF16 (isa amx, below), sums in the tile unit's order (blocks of 16 pairs, even and odd products
// summed apart, then added to the accumulator), on the tile unit for calls of 3+ rows and on the vector units for
// 1-2 rows, with the same bits; a process picks one path for every call (cpu_kernel.py), so rows stay invariant.
//
// One difference between the two paths: VDPBF16PS treats subnormal inputs as zero and flushes subnormal results
// (it ignores MXCSR); the portable loop keeps IEEE subnormals. They give the same bits unless a product or a
// partial sum falls below 2^-126 in magnitude. A process always uses one path for every call (`isa = auto`
// resolves once, from the CPU), so this never breaks batch invariance; it only matters when comparing the paths.
//
// Prepacked linear weight (kernels/linear/naive.py: pack_weight): [G, Kp/2, 64, 2] bf16, G = ceil(N/64) groups of
// 64 output columns, Kp = K rounded up to even; element [g, p, c, j] = w[64g + c, 2p + j], zero outside w. One
// group is one contiguous stream of 256 bytes per K pair: four 64-byte vectors of (even, odd) pairs, one per 16
// columns, exactly VDPBF16PS's operand. bmm reads w [K, N] rows directly and interleaves rows 2p and 2p+1 in
// registers (vpunpcklwd / vpunpckhwd: the columns come out permuted inside each vector, undone at the store); a
// work item with more than one row tile first packs its 64 columns that way into a per-thread buffer and runs the
// packed tiles on it (the same pairs in the same order: the same bits).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_features.h"  // kernels/cpu/: EM_X86, EM_AMX, em_cpu::features(), em_cpu::amx_usable()

namespace {

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4, kAvx2 = 5 };

constexpr int64_t kCols = 64;  // output columns per group: 4 vectors of 16 fp32 lanes
constexpr int kMR = 6;         // rows per register tile (6 x 4 accumulators + 4 weight vectors + 1 broadcast)

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // c10::BFloat16's round_to_nearest_even
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One tile: MR rows of x (row pointers, K bf16 each) against one column group of the weight.
//   packed: w points at the group ([Kp/2, 64, 2]); kn: w points at column n0 of row 0 of [K, N] (row stride ldw).
// ncols (1..64) columns are valid; y row pointers point at column n0.
struct Tile {
  const uint16_t* x[kMR];
  uint16_t* y[kMR];
  const uint16_t* w;
  int64_t ldw;
  int64_t ncols;
};

template <bool PACKED>
inline float weight_at(const Tile& t, int64_t c, int64_t k) {
  if (PACKED) return bf16_to_float(t.w[(k / 2) * (2 * kCols) + 2 * c + (k & 1)]);
  return bf16_to_float(t.w[k * t.ldw + c]);
}

template <bool PACKED>
void tile_portable(const Tile& t, int mr, int64_t K) {
  const int64_t P = K / 2;
  for (int r = 0; r < mr; ++r) {
    const uint16_t* x = t.x[r];
    for (int64_t c = 0; c < t.ncols; ++c) {
      float acc = 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        const float po = bf16_to_float(x[2 * p + 1]) * weight_at<PACKED>(t, c, 2 * p + 1);
        acc = acc + po;
        const float pe = bf16_to_float(x[2 * p]) * weight_at<PACKED>(t, c, 2 * p);
        acc = acc + pe;
      }
      if (K & 1) {
        const float zero = 0.0f;
        acc = acc + zero * zero;
        const float pe = bf16_to_float(x[K - 1]) * weight_at<PACKED>(t, c, K - 1);
        acc = acc + pe;
      }
      t.y[r][c] = float_to_bf16(acc);
    }
  }
}

#ifdef EM_X86
#define EM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// The helpers below need no AVX512-BF16: the FMA path (isa avx512) inlines them too.
#define EM_TARGET_BW __attribute__((target("avx512f,avx512bw,avx512vl")))
// Software prefetch on the packed weight stream, K pairs ahead, in the first row tile of a work item only (the one
// that streams the column group from memory; the later tiles find it in L2, where extra prefetches only cost).
constexpr int64_t kPrefetchPairs = 8;

EM_TARGET_BW inline __m256i round_to_bf16(__m512 a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

EM_TARGET_BW inline __mmask32 mask32(int64_t n) {  // the first n (clamped to 0..32) of 32 lanes
  return n >= 32 ? __mmask32(0xFFFFFFFFu) : (n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1u));
}

EM_TARGET_BW inline __m512i bcast_pair(const uint16_t* x) {
  uint32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_set1_epi32(int(v));
}

// The weight operand of K pair p for the 64 columns: four vectors of (even, odd) bf16 pairs.
template <bool PACKED, bool PREFETCH>
EM_TARGET_BW inline void load_pair(__m512i* v, const uint16_t* w, int64_t ldw, __mmask32 m0, __mmask32 m1,
                                int64_t p) {
  if (PACKED) {
    const uint16_t* wp = w + p * (2 * kCols);
    if (PREFETCH)
      for (int c = 0; c < 4; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchPairs * 2 * kCols + 32 * c), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(wp + 32 * c);
  } else {
    const uint16_t* r0 = w + 2 * p * ldw;
    const uint16_t* r1 = r0 + ldw;
    const __m512i a0 = _mm512_maskz_loadu_epi16(m0, r0), a1 = _mm512_maskz_loadu_epi16(m1, r0 + 32);
    const __m512i b0 = _mm512_maskz_loadu_epi16(m0, r1), b1 = _mm512_maskz_loadu_epi16(m1, r1 + 32);
    v[0] = _mm512_unpacklo_epi16(a0, b0);
    v[1] = _mm512_unpackhi_epi16(a0, b0);
    v[2] = _mm512_unpacklo_epi16(a1, b1);
    v[3] = _mm512_unpackhi_epi16(a1, b1);
  }
}

// One column group of a [K, N] weight (w at column n0 of row 0, ncols valid) into the packed layout
// ([Kp/2, 64, 2], columns in order, zero outside w): the same pairs the kn tile would build, stored once so that
// several row tiles can share them.
// The last row of an odd K as pairs (w[K-1], 0) in the layout load_pair gives: r0 = that row, 64 columns masked.
EM_TARGET_BW inline void load_last_row(__m512i* v, const uint16_t* r0, __mmask32 m0, __mmask32 m1) {
  const __m512i a0 = _mm512_maskz_loadu_epi16(m0, r0), a1 = _mm512_maskz_loadu_epi16(m1, r0 + 32);
  const __m512i z = _mm512_setzero_si512();
  v[0] = _mm512_unpacklo_epi16(a0, z);
  v[1] = _mm512_unpackhi_epi16(a0, z);
  v[2] = _mm512_unpacklo_epi16(a1, z);
  v[3] = _mm512_unpackhi_epi16(a1, z);
}

EM_TARGET_BW void pack_group_avx512(const uint16_t* w, int64_t ldw, int64_t ncols, int64_t K, uint16_t* buf) {
  const __mmask32 m0 = mask32(ncols), m1 = mask32(ncols - 32);
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t P = K / 2;
  __m512i v[4];
  for (int64_t p = 0; p <= P; ++p) {
    if (p < P) {
      load_pair<false, false>(v, w, ldw, m0, m1, p);
    } else {
      if (!(K & 1)) break;
      load_last_row(v, w + (K - 1) * ldw, m0, m1);
    }
    uint16_t* dst = buf + p * (2 * kCols);
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_si512(dst + 64 * h, _mm512_permutex2var_epi32(v[2 * h], lo_idx, v[2 * h + 1]));
      _mm512_storeu_si512(dst + 64 * h + 32, _mm512_permutex2var_epi32(v[2 * h], hi_idx, v[2 * h + 1]));
    }
  }
}

// The accumulators of MR rows (acc[r][c]: columns 16c .. 16c+15 of the group) rounded to bf16 into the rows' y.
// kn: vector 2h holds columns 32h + {0-3, 8-11, 16-19, 24-27} and vector 2h+1 columns 32h + {4-7, 12-15, 20-23,
// 28-31} (unpack works inside 128-bit lanes): put them back in order.
template <int MR, bool PACKED>
EM_TARGET_BW inline void store_rows(const Tile& t, const __m512 (&acc)[MR][4]) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < MR; ++r) {
    __m512 out[4];
    if (PACKED) {
      for (int c = 0; c < 4; ++c) out[c] = acc[r][c];
    } else {
      for (int h = 0; h < 2; ++h) {
        out[2 * h] = _mm512_permutex2var_ps(acc[r][2 * h], lo_idx, acc[r][2 * h + 1]);
        out[2 * h + 1] = _mm512_permutex2var_ps(acc[r][2 * h], hi_idx, acc[r][2 * h + 1]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      const int64_t left = t.ncols - 16 * c;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
      _mm256_mask_storeu_epi16(t.y[r] + 16 * c, m, round_to_bf16(out[c]));
    }
  }
}

template <int MR, bool PACKED, bool STREAM>
EM_TARGET void tile_avx512(const Tile& t, int64_t K) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t P = K / 2;
  const __mmask32 m0 = mask32(t.ncols), m1 = mask32(t.ncols - 32);
  const uint16_t* w = t.w;
  const int64_t ldw = t.ldw;
  __m512i v[4];
  for (int64_t p = 0; p < P; ++p) {
    load_pair<PACKED, STREAM>(v, w, ldw, m0, m1, p);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)bcast_pair(t.x[r] + 2 * p);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, (__m512bh)v[c]);
    }
  }
  if (K & 1) {  // the last pair: (x[K-1], 0) . (w[K-1], 0)
    if (PACKED) {
      for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(w + P * (2 * kCols) + 32 * c);  // zero-padded
    } else {
      load_last_row(v, w + (K - 1) * ldw, m0, m1);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(t.x[r][K - 1]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, (__m512bh)v[c]);
    }
  }
  store_rows<MR, PACKED>(t, acc);
}

// ------------------------------------------------------------------------------- FMA paths (no AVX512-BF16)
// The VDPBF16PS steps on plain fp32 FMA units, for CPUs without AVX512-BF16 (Skylake to Ice Lake servers, AVX2-only
// EPYCs). A 32-bit lane of a packed weight vector holds one (even, odd) pair: masking off its low half leaves the
// odd element as an fp32 value, shifting it up 16 bits gives the even one; the input pair splits the same way. A
// bf16 product is exact in fp32, so fma(x_odd, w_odd, acc) and then fma(x_even, w_even, acc) round exactly where
// the portable loop's two additions do: the portable path's bits (IEEE subnormals, no flushing). The one place they
// can differ is a product that is itself an fp32 subnormal (below 2^-126), which the portable loop rounds before
// adding and the FMA does not. Subnormals aside, these are also VDPBF16PS's bits.
constexpr int kFmaRows = 4;  // avx512: 4 x 4 accumulators + 8 split weight vectors + 2 split inputs

// One K pair for MR rows: xb[r] the rows' input pairs broadcast, v the four weight pair vectors.
template <int MR>
EM_TARGET_BW inline void fma_pair(__m512 (&acc)[MR][4], const __m512i (&xb)[MR], const __m512i* v) {
  const __m512i odd = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 we[4], wo[4];
  for (int c = 0; c < 4; ++c) {
    wo[c] = _mm512_castsi512_ps(_mm512_and_si512(v[c], odd));
    we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16));
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(xb[r], odd));
    const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(xb[r], 16));
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xe, we[c], _mm512_fmadd_ps(xo, wo[c], acc[r][c]));
  }
}

template <int MR, bool PACKED, bool STREAM>
EM_TARGET_BW void tile_avx512_fma(const Tile& t, int64_t K) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t P = K / 2;
  const __mmask32 m0 = mask32(t.ncols), m1 = mask32(t.ncols - 32);
  __m512i v[4], xb[MR];
  for (int64_t p = 0; p < P; ++p) {
    load_pair<PACKED, STREAM>(v, t.w, t.ldw, m0, m1, p);
    for (int r = 0; r < MR; ++r) xb[r] = bcast_pair(t.x[r] + 2 * p);
    fma_pair<MR>(acc, xb, v);
  }
  if (K & 1) {  // the last pair: (x[K-1], 0) . (w[K-1], 0)
    if (PACKED) {
      for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(t.w + P * (2 * kCols) + 32 * c);  // zero-padded
    } else {
      load_last_row(v, t.w + (K - 1) * t.ldw, m0, m1);
    }
    for (int r = 0; r < MR; ++r) xb[r] = _mm512_set1_epi32(int(t.x[r][K - 1]));
    fma_pair<MR>(acc, xb, v);
  }
  store_rows<MR, PACKED>(t, acc);
}

// AVX2 + FMA: 8 lanes and 16 registers, so a tile runs its 64 columns as two halves of 32 (four vectors each) over
// packed weights only (run_gemm packs a kn weight first). The same steps per element as above.
#define EM_TARGET_AVX2 __attribute__((target("avx2,fma")))
constexpr int kAvx2Rows = 2;  // 2 x 4 accumulators + 4 split inputs + a weight vector split in two

template <int MR>
EM_TARGET_AVX2 inline void fma_pair_avx2(__m256 (&acc)[MR][4], const uint32_t (&pair)[MR], const uint16_t* w) {
  const __m256i odd = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 xo[MR], xe[MR];
  for (int r = 0; r < MR; ++r) {
    const __m256i xb = _mm256_set1_epi32(int(pair[r]));
    xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xb, odd));
    xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
  }
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * c));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, odd));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(xe[r], we, _mm256_fmadd_ps(xo[r], wo, acc[r][c]));
  }
}

template <int MR>
EM_TARGET_AVX2 void tile_avx2(const Tile& t, int64_t K) {
  const int64_t P = K / 2;
  for (int h = 0; h < 2 && 32 * h < t.ncols; ++h) {
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint16_t* w = t.w + 64 * h;  // pair p's 32 columns of this half: w + p * 128, 64 bf16
    uint32_t pair[MR];
    for (int64_t p = 0; p < P; ++p) {
      for (int r = 0; r < MR; ++r) std::memcpy(&pair[r], t.x[r] + 2 * p, sizeof(uint32_t));
      fma_pair_avx2<MR>(acc, pair, w + p * (2 * kCols));
    }
    if (K & 1) {  // (x[K-1], 0) . (w[K-1], 0): the packed weight's last pair is zero-padded
      for (int r = 0; r < MR; ++r) pair[r] = t.x[r][K - 1];
      fma_pair_avx2<MR>(acc, pair, w + P * (2 * kCols));
    }
    alignas(32) float out[8];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < 4; ++c) {
        const int64_t col = 32 * h + 8 * c, left = std::min<int64_t>(8, t.ncols - col);
        if (left <= 0) break;
        _mm256_store_ps(out, acc[r][c]);
        for (int64_t i = 0; i < left; ++i) t.y[r][col + i] = float_to_bf16(out[i]);
      }
  }
}
#endif

#ifdef EM_AMX
// ------------------------------------------------------------------------------------------------------ AMX
// AMX-BF16 (TDPBF16PS): C[16 rows, 16 fp32 columns] += A[16 rows, 16 K pairs] . B[16 K pairs, 16 columns of
// (even, odd) pairs]. B is the packed layout as it stands: one 16-column slice of a group over 16 pairs is 16 rows
// of 64 bytes, 256 bytes apart. Each output element is one fp32 accumulator that starts at +0 and takes the K
// pairs in order, 16 pairs per instruction, the last block holding the remaining 1..16 pairs (its own tile shape,
// fixed by K): which instruction sees which pairs depends only on K, and an element's arithmetic inside the tile
// unit depends only on its own row of A and column of B. So, as on the other paths, a row's result does not
// depend on M, its position, the tiling or the thread count. The tile unit's order is not the VDPBF16PS steps
// above (tile_amx_vec below spells it out), so a process uses AMX for every call or for none (cpu_kernel.py
// resolves isa auto once per process).
constexpr int64_t kAmxRows = 16;    // rows per AMX tile
constexpr int64_t kAmxPairs = 16;   // K pairs per TDPBF16PS (64 bytes of A per row)

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

using em_cpu::amx_usable;

// tmm0-3: C, columns 16c .. 16c+15 of the group; tmm4 / tmm5: A / B of a full block of 16 pairs; tmm6 / tmm7: A / B
// of the last block (tail pairs, 1..16).
__attribute__((target("amx-tile"))) inline void amx_configure(int64_t tail) {
  AmxConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = uint8_t(kAmxRows);
    cfg.colsb[i] = 64;
  }
  cfg.colsb[6] = uint16_t(4 * tail);
  cfg.rows[7] = uint8_t(tail);
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes of the config as read, so -O3 drops the
  // stores of the rest. Here the whole 64-byte struct is the operand.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// Up to 16 rows against one packed column group. a: 16 rows of 32 * blocks elements, `sa` bytes apart, zero past
// K (x itself, or its rows copied into a padded buffer); w: the group ([Kp/2, 64, 2]); c: [16, 64] fp32 scratch.
// Needs amx_configure(tail) on this thread.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void tile_amx(const uint16_t* a, int64_t sa, const uint16_t* w, int64_t blocks, float* c, uint16_t* const* y,
              int mr, int64_t ncols) {
  const int64_t sw = 2 * kCols * 2, sc = kCols * 4;  // strides in bytes
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
// One block: A into tile TA, then each 16-column slice of B into TB and onto its accumulator (tile numbers are
// part of the instruction, so a macro, not a function).
#define EM_AMX_BLOCK(TA, TB, blk)                                  \
  do {                                                             \
    const uint16_t* wb = w + (blk) * kAmxPairs * 2 * kCols;        \
    _tile_loadd(TA, a + (blk) * 2 * kAmxPairs, sa);                \
    _tile_loadd(TB, wb, sw);                                       \
    _tile_dpbf16ps(0, TA, TB);                                     \
    _tile_loadd(TB, wb + 32, sw);                                  \
    _tile_dpbf16ps(1, TA, TB);                                     \
    _tile_loadd(TB, wb + 64, sw);                                  \
    _tile_dpbf16ps(2, TA, TB);                                     \
    _tile_loadd(TB, wb + 96, sw);                                  \
    _tile_dpbf16ps(3, TA, TB);                                     \
  } while (0)
  for (int64_t blk = 0; blk + 1 < blocks; ++blk) EM_AMX_BLOCK(4, 5, blk);
  EM_AMX_BLOCK(6, 7, blocks - 1);  // the last block: its own tile shapes (1..16 pairs)
#undef EM_AMX_BLOCK
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c + 32, sc);
  _tile_stored(3, c + 48, sc);
  for (int r = 0; r < mr; ++r)
    for (int q = 0; q < 4; ++q) {
      const int64_t left = ncols - 16 * q;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
      _mm256_mask_storeu_epi16(y[r] + 16 * q, m, round_to_bf16(_mm512_loadu_ps(c + r * kCols + 16 * q)));
    }
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// The tile unit's arithmetic on the vector units, for calls with few rows (an AMX tile costs the same for one row as
// for 16, and the tile path packs a bmm weight per call). What TDPBF16PS computes per output element, found
// bitwise on this project's CPU (tests/kernels/test_linear_cpu_kernel.py compares the two paths): over one instruction's K
// pairs, the even products and the odd products are summed apart, each in fp32 in pair order starting at +0, and
// their sum is added to the accumulator — c = c + (S_even + S_odd) — with subnormal inputs read as zero and
// subnormal results flushed (MXCSR DAZ + FTZ here). A bf16 product is exact in fp32, so one FMA is one such
// step. Blocks of 16 pairs as on the tile path (the last block 1..16 pairs), so the bits are the tile path's.
constexpr int kAmxVecRows = 2;  // rows per register tile: 2 x (4 accumulators + 8 partial sums)

template <int MR, bool PACKED, bool STREAM>
EM_TARGET void tile_amx_vec(const Tile& t, int64_t K) {
  const int64_t P = K / 2, Pp = (K + 1) / 2;  // whole pairs; pairs with a padded last one
  const __mmask32 m0 = mask32(t.ncols), m1 = mask32(t.ncols - 32);
  const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  __m512i v[4];
  for (int64_t p0 = 0; p0 < Pp; p0 += kAmxPairs) {
    const int64_t p1 = std::min(Pp, p0 + kAmxPairs);
    __m512 se[MR][4], so[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < 4; ++c) se[r][c] = so[r][c] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; ++p) {
      __m512 xe[MR], xo[MR];
      if (p < P) {
        load_pair<PACKED, STREAM>(v, t.w, t.ldw, m0, m1, p);
        for (int r = 0; r < MR; ++r) {
          xe[r] = _mm512_set1_ps(bf16_to_float(t.x[r][2 * p]));
          xo[r] = _mm512_set1_ps(bf16_to_float(t.x[r][2 * p + 1]));
        }
      } else {  // odd K: the pair (x[K-1], 0) . (w[K-1], 0)
        if (PACKED) {
          for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(t.w + P * (2 * kCols) + 32 * c);  // zero-padded
        } else {
          load_last_row(v, t.w + (K - 1) * t.ldw, m0, m1);
        }
        for (int r = 0; r < MR; ++r) {
          xe[r] = _mm512_set1_ps(bf16_to_float(t.x[r][K - 1]));
          xo[r] = _mm512_setzero_ps();
        }
      }
      for (int c = 0; c < 4; ++c) {
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v[c], odd_mask));
        for (int r = 0; r < MR; ++r) {
          se[r][c] = _mm512_fmadd_ps(xe[r], we, se[r][c]);
          so[r][c] = _mm512_fmadd_ps(xo[r], wo, so[r][c]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_add_ps(se[r][c], so[r][c]));
  }
  store_rows<MR, PACKED>(t, acc);
}
#endif

int64_t resolve_isa(int64_t isa) {
#ifdef EM_X86
  const em_cpu::Features& f = em_cpu::features();
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl;
  const bool has = avx512 && f.avx512bf16;
  const bool avx2 = f.avx2 && f.fma;
  // auto: the fastest path this CPU runs; every path below AMX computes the same steps (AMX its own order)
  const int64_t vector = has ? kAvx512Bf16 : avx512 ? kAvx512 : avx2 ? kAvx2 : kPortable;
#ifdef EM_AMX
  if (isa == kAuto) return has && amx_usable() ? kAmx : vector;
#else
  if (isa == kAuto) return vector;
#endif
  TORCH_CHECK(isa == kPortable || isa == kAvx512 || isa == kAvx512Bf16 || isa == kAmx || isa == kAvx2,
              "row-invariant linear: unknown isa code ", isa);
  TORCH_CHECK(isa != kAvx512Bf16 || has, "row-invariant linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(isa != kAvx512 || avx512, "row-invariant linear: this CPU has no AVX-512 (F, BW, VL)");
  TORCH_CHECK(isa != kAvx2 || avx2, "row-invariant linear: this CPU has no AVX2 + FMA");
#ifdef EM_AMX
  // asked for the tile state only when AMX is asked for
  TORCH_CHECK(isa != kAmx || (has && amx_usable()), "row-invariant linear: this CPU (or its operating system) offers "
              "no AMX-BF16");
#else
  TORCH_CHECK(isa != kAmx, "row-invariant linear: AMX runs only on x86-64 Linux");
#endif
  return isa;
#else
  TORCH_CHECK(isa == kAuto || isa == kPortable, "row-invariant linear: only the portable path exists on this CPU");
  return kPortable;
#endif
}

template <int MR, bool PACKED>
void run_tile_mr(const Tile& t, int64_t K, bool stream) {
#ifdef EM_X86
  if (stream) return tile_avx512<MR, PACKED, true>(t, K);
  return tile_avx512<MR, PACKED, false>(t, K);
#endif
}

#ifdef EM_AMX
template <int MR, bool PACKED>
void run_amx_vec_mr(const Tile& t, int64_t K, bool stream) {
  if (stream) return tile_amx_vec<MR, PACKED, true>(t, K);
  return tile_amx_vec<MR, PACKED, false>(t, K);
}
#endif

template <bool PACKED>
void run_tile(int64_t isa, const Tile& t, int mr, int64_t K, bool stream) {
#ifdef EM_AMX
  static_assert(kAmxVecRows == 2, "run_tile dispatches 1 or 2 rows to tile_amx_vec");
  if (isa == kAmx) {
    if (mr == 1) return run_amx_vec_mr<1, PACKED>(t, K, stream);
    return run_amx_vec_mr<2, PACKED>(t, K, stream);
  }
#endif
#ifdef EM_X86
  if (isa == kAvx512) {
    static_assert(kFmaRows == 4, "run_tile dispatches 1 to 4 rows to tile_avx512_fma");
    switch (mr) {
      case 1: return stream ? tile_avx512_fma<1, PACKED, true>(t, K) : tile_avx512_fma<1, PACKED, false>(t, K);
      case 2: return stream ? tile_avx512_fma<2, PACKED, true>(t, K) : tile_avx512_fma<2, PACKED, false>(t, K);
      case 3: return stream ? tile_avx512_fma<3, PACKED, true>(t, K) : tile_avx512_fma<3, PACKED, false>(t, K);
      default: return stream ? tile_avx512_fma<4, PACKED, true>(t, K) : tile_avx512_fma<4, PACKED, false>(t, K);
    }
  }
  if constexpr (PACKED) {  // run_gemm packs a kn weight before an avx2 tile sees it
    static_assert(kAvx2Rows == 2, "run_tile dispatches 1 or 2 rows to tile_avx2");
    if (isa == kAvx2) return mr == 1 ? tile_avx2<1>(t, K) : tile_avx2<2>(t, K);
  }
  if (isa == kAvx512Bf16) {
    switch (mr) {
      case 1: return run_tile_mr<1, PACKED>(t, K, stream);
      case 2: return run_tile_mr<2, PACKED>(t, K, stream);
      case 3: return run_tile_mr<3, PACKED>(t, K, stream);
      case 4: return run_tile_mr<4, PACKED>(t, K, stream);
      case 5: return run_tile_mr<5, PACKED>(t, K, stream);
      default: return run_tile_mr<6, PACKED>(t, K, stream);
    }
  }
#endif
  tile_portable<PACKED>(t, mr, K);
}

void pack_group_portable(const uint16_t* w, int64_t ldw, int64_t ncols, int64_t K, uint16_t* buf) {
  const int64_t Kp = K + (K & 1);
  for (int64_t k = 0; k < Kp; ++k)
    for (int64_t c = 0; c < kCols; ++c)
      buf[(k / 2) * (2 * kCols) + 2 * c + (k & 1)] = (k < K && c < ncols) ? w[k * ldw + c] : uint16_t(0);
}

void pack_group(int64_t isa, const uint16_t* w, int64_t ldw, int64_t ncols, int64_t K, uint16_t* buf) {
#ifdef EM_X86
  if (isa == kAvx512 || isa == kAvx512Bf16 || isa == kAmx) return pack_group_avx512(w, ldw, ncols, K, buf);
#endif
  pack_group_portable(w, ldw, ncols, K, buf);
}

// Every (batch item, column group, row chunk) is one work item; a thread runs whole items. x/y/w: base pointers
// and strides in elements.
struct Gemm {
  const uint16_t* x;
  int64_t sxb, sxm;
  const uint16_t* w;
  int64_t swb, ldw;  // batch stride; kn: and the K-row stride (packed: ldw unused, a group's stride computed)
  uint16_t* y;
  int64_t syb, sym;
  int64_t B, M, N, K;
};

#ifdef EM_AMX
// The AMX path of run_gemm: work items as there (batch item, column group, row chunk), rows in tiles of 16. A
// whole tile of a K that fills its last block (K a multiple of 32: the model's projections) is read where x is;
// otherwise the tile's rows are copied into a zero-padded [16, KA] buffer (the A operand takes whole 64-byte
// rows, and a short tile must not read past x). kn weights are packed per item as on the other path.
template <bool PACKED>
void run_gemm_amx(const Gemm& g) {
  const int64_t G = (g.N + kCols - 1) / kCols;
  const int64_t P = (g.K + (g.K & 1)) / 2;
  const int64_t blocks = (P + kAmxPairs - 1) / kAmxPairs, tail = P - (blocks - 1) * kAmxPairs;
  const int64_t KA = blocks * 2 * kAmxPairs;
  const int64_t MC = g.M <= 8 * kAmxRows ? g.M : 8 * kAmxRows;   // a group's weight stays in L2 over 8 tiles
  const int64_t MCn = (g.M + MC - 1) / MC;
  const int64_t items = g.B * G * MCn;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> a(size_t(kAmxRows * KA), 0);
    std::vector<uint16_t> buf(PACKED ? 0 : size_t(P) * 2 * kCols);
    alignas(64) float c[kAmxRows * kCols];
    uint16_t* y[kAmxRows];
    amx_configure(tail);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mc = i % MCn, gi = (i / MCn) % G, b = i / (MCn * G);
      const int64_t ncols = std::min<int64_t>(kCols, g.N - gi * kCols);
      const uint16_t* w = PACKED ? g.w + b * g.swb + gi * P * 2 * kCols : g.w + b * g.swb + gi * kCols;
      if (!PACKED) {
        pack_group_avx512(w, g.ldw, ncols, g.K, buf.data());
        w = buf.data();
      }
      const int64_t m_end = std::min(g.M, (mc + 1) * MC);
      for (int64_t m = mc * MC; m < m_end; m += kAmxRows) {
        const int mr = int(std::min<int64_t>(kAmxRows, m_end - m));
        const uint16_t* x0 = g.x + b * g.sxb + m * g.sxm;
        for (int r = 0; r < mr; ++r) y[r] = g.y + b * g.syb + (m + r) * g.sym + gi * kCols;
        if (KA == g.K && mr == kAmxRows) {
          tile_amx(x0, g.sxm * 2, w, blocks, c, y, mr, ncols);
          continue;
        }
        for (int r = 0; r < mr; ++r) {
          uint16_t* row = a.data() + r * KA;
          std::memcpy(row, x0 + r * g.sxm, size_t(g.K) * 2);
          std::memset(row + g.K, 0, size_t(KA - g.K) * 2);
        }
        tile_amx(a.data(), KA * 2, w, blocks, c, y, mr, ncols);
      }
    }
    amx_release();
  });
}
#endif

// AMX calls with fewer rows than this run the tile unit's arithmetic on the vector units (tile_amx_vec): the same
// bits, faster where a tile would be mostly empty (bench/linear_kernel.py measured the crossover).
constexpr int64_t kAmxMinRows = 3;

#ifdef EM_X86
// Subnormal inputs read as zero, subnormal results flushed (MXCSR DAZ + FTZ) while alive, as the tile unit does.
struct FlushSubnormals {
  unsigned saved;
  FlushSubnormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};
#endif

template <bool PACKED>
void run_gemm(int64_t isa, const Gemm& g) {
#ifdef EM_AMX
  if (isa == kAmx && g.M >= kAmxMinRows) return run_gemm_amx<PACKED>(g);
#endif
#ifdef EM_X86
  const int64_t mr_max = isa == kAmx ? kAmxVecRows : isa == kAvx512 ? kFmaRows : isa == kAvx2 ? kAvx2Rows : kMR;
#else
  const int64_t mr_max = kMR;
#endif
  const int64_t G = (g.N + kCols - 1) / kCols;
  const int64_t Kp = g.K + (g.K & 1);
  // rows per work item: all of them for decode-sized M (one pass over the weight), else chunks of 16 tiles so
  // both threads have work and a column group's weight stays in cache across its row tiles.
  const int64_t MC = g.M <= 16 * mr_max ? g.M : 16 * mr_max;
  const int64_t MCn = (g.M + MC - 1) / MC;
  const int64_t items = g.B * G * MCn;
  // kn weights and more than one row tile per item: the item packs its column group once (into a per-thread
  // buffer, K x 128 bytes) and runs the packed tiles on it — the same pairs in the same order, so the same bits.
  // (avx2 tiles read packed weights only: there every kn item packs)
  const bool repack = !PACKED && (MC > mr_max || isa == kAvx2);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
#ifdef EM_X86
    std::optional<FlushSubnormals> flush;
    if (isa == kAmx) flush.emplace();
#endif
    std::vector<uint16_t> buf(repack ? size_t(Kp / 2) * 2 * kCols : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mc = i % MCn, gi = (i / MCn) % G, b = i / (MCn * G);
      Tile t;
      t.w = PACKED ? g.w + b * g.swb + gi * (Kp / 2) * (2 * kCols) : g.w + b * g.swb + gi * kCols;
      t.ldw = g.ldw;
      t.ncols = std::min<int64_t>(kCols, g.N - gi * kCols);
      if (repack) {
        pack_group(isa, t.w, t.ldw, t.ncols, g.K, buf.data());
        t.w = buf.data();
      }
      const int64_t m_end = std::min(g.M, (mc + 1) * MC);
      for (int64_t m = mc * MC; m < m_end; m += mr_max) {
        const int mr = int(std::min<int64_t>(mr_max, m_end - m));
        for (int r = 0; r < mr; ++r) {
          t.x[r] = g.x + b * g.sxb + (m + r) * g.sxm;
          t.y[r] = g.y + b * g.syb + (m + r) * g.sym + gi * kCols;
        }
        if (repack) run_tile<true>(isa, t, mr, g.K, false);
        else run_tile<PACKED>(isa, t, mr, g.K, m == mc * MC);
      }
    }
  });
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": expected bfloat16, found ", t.scalar_type());
}

const uint16_t* cptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }
uint16_t* mptr(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr()); }

// A checked call on packed weights (linear, bmm_packed): nothing to do for an empty output, zeros for K = 0.
void run_packed(const Gemm& g, const at::Tensor& out, int64_t isa) {
  if (g.B == 0 || g.M == 0 || g.N == 0) return;
  if (g.K == 0) {
    out.zero_();
    return;
  }
  run_gemm<true>(resolve_isa(isa), g);
}

// x [M, K] bf16 (unit stride along K), w_packed [ceil(N/64), Kp/2, 64, 2] bf16 -> out [M, N] bf16 (preallocated,
// contiguous).
void linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, const at::Tensor& out, int64_t isa) {
  check_bf16(x, "x");
  check_bf16(w, "w_packed");
  check_bf16(out, "out");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.stride(1) == 1 || K <= 1), "x: expected [M, ", K,
              "] with unit stride along K, found ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(N >= 0 && K >= 0, "linear: N and K must be >= 0");
  const int64_t G = (N + kCols - 1) / kCols, Kp = K + (K & 1);
  TORCH_CHECK(w.dim() == 4 && w.size(0) == G && w.size(1) == Kp / 2 && w.size(2) == kCols && w.size(3) == 2 &&
                  w.is_contiguous(),
              "w_packed: expected a contiguous [", G, ", ", Kp / 2, ", 64, 2] tensor (pack_weight of an [", N, ", ",
              K, "] weight), found ", w.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N && out.is_contiguous(),
              "out: expected a contiguous [", x.size(0), ", ", N, "] tensor");
  run_packed(Gemm{cptr(x), 0, x.stride(0), cptr(w), 0, 0, mptr(out), 0, N, 1, x.size(0), N, K}, out, isa);
}

// x [B, M, K] bf16 (unit stride along K), w [B, K, N] bf16 (unit stride along N) -> out [B, M, N] bf16
// (preallocated, contiguous).
void bmm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, int64_t isa) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  check_bf16(out, "out");
  TORCH_CHECK(x.dim() == 3 && (x.stride(2) == 1 || x.size(2) <= 1), "x: expected [B, M, K] with unit stride along K, found ",
              x.sizes(), " strides ", x.strides());
  const int64_t B = x.size(0), M = x.size(1), K = x.size(2);
  TORCH_CHECK(w.dim() == 3 && w.size(0) == B && w.size(1) == K && (w.stride(2) == 1 || w.size(2) <= 1),
              "w: expected [", B, ", ", K, ", N] with unit stride along N, found ", w.sizes(), " strides ",
              w.strides());
  const int64_t N = w.size(2);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == B && out.size(1) == M && out.size(2) == N && out.is_contiguous(),
              "out: expected a contiguous [", B, ", ", M, ", ", N, "] tensor");
  if (B == 0 || M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  Gemm g{cptr(x), x.stride(0), x.stride(1), cptr(w), w.stride(0), w.stride(1), mptr(out), M * N, N, B, M, N, K};
  run_gemm<false>(resolve_isa(isa), g);
}

// x [B, M, K] bf16 (unit stride along K), w_packed [B, ceil(N/64), Kp/2, 64, 2] bf16 (each w[b] [K, N] packed as
// pack_weight packs its transpose) -> out [B, M, N] bf16 (preallocated, contiguous). The kn path's pairs in the
// kn path's order (it packs each column group per item the same way), so bmm's bits; the weight streams from
// contiguous memory instead of 128-byte pieces of K strided rows.
void bmm_packed(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, const at::Tensor& out, int64_t isa) {
  check_bf16(x, "x");
  check_bf16(w, "w_packed");
  check_bf16(out, "out");
  TORCH_CHECK(x.dim() == 3 && x.size(2) == K && (x.stride(2) == 1 || K <= 1), "x: expected [B, M, ", K,
              "] with unit stride along K, found ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(N >= 0 && K >= 0, "bmm_packed: N and K must be >= 0");
  const int64_t B = x.size(0), M = x.size(1), G = (N + kCols - 1) / kCols, Kp = K + (K & 1);
  TORCH_CHECK(w.dim() == 5 && w.size(0) == B && w.size(1) == G && w.size(2) == Kp / 2 && w.size(3) == kCols &&
                  w.size(4) == 2 && w.is_contiguous(),
              "w_packed: expected a contiguous [", B, ", ", G, ", ", Kp / 2, ", 64, 2] tensor (pack_bmm_weight of a [",
              B, ", ", K, ", ", N, "] weight), found ", w.sizes());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == B && out.size(1) == M && out.size(2) == N && out.is_contiguous(),
              "out: expected a contiguous [", B, ", ", M, ", ", N, "] tensor");
  run_packed(Gemm{cptr(x), x.stride(0), x.stride(1), cptr(w), G * (Kp / 2) * 2 * kCols, 0, mptr(out), M * N, N, B,
                  M, N, K}, out, isa);
}

// ---------------------------------------------------------------------------------------------- fp32 linear
// y[m, n] = Σ_k x[m, k] · w[n, k] for fp32 x [M, K] and w [N, K] (the routing and indexer-head weights), in one
// order that depends only on K: 16 lanes, lane j sums the rounded products of k = 16c + j in ascending c from +0
// (product, then add: two roundings; no FP contraction in this build), a short last chunk adds only its lanes;
// then the lanes are folded by halves (j + 8, + 4, + 2, + 1). `naive.linear_fp32_in_lane_order` spells it out.
constexpr int kLanes = 16;
constexpr int64_t kF32Rows = 8;   // rows per register block: each w vector loaded once for 8 rows
constexpr int kF32Cols = 3;       // columns per register block: 24 accumulators + 3 weight vectors + 1 input

inline float fold_lanes(float* l) {
  for (int h = kLanes / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
  return l[0];
}

void f32_rows_portable(const float* x, int64_t sx, const float* w, int64_t K, float* y, int64_t sy, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float l[kLanes] = {};
    for (int64_t k = 0; k < K; ++k) l[k % kLanes] = l[k % kLanes] + x[r * sx + k] * w[k];
    y[r * sy] = fold_lanes(l);
  }
}

#ifdef EM_X86
// NC columns × `rows` (≤ kF32Rows) rows: each w vector loaded once for the rows, each x vector once for the columns
template <int NC>
__attribute__((target("avx512f"))) void f32_block_avx512(const float* x, int64_t sx, const float* w, int64_t K,
                                                         float* y, int64_t sy, int64_t rows) {
  __m512 acc[NC][kF32Rows];
  for (int c = 0; c < NC; ++c)
    for (int64_t r = 0; r < rows; ++r) acc[c][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    __m512 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * sx + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm512_add_ps(acc[c][r], _mm512_mul_ps(xv, wv[c]));
    }
  }
  if (k < K) {  // the short last chunk: its lanes only, the others kept as they are (a +0 would turn −0 into +0)
    const __mmask16 m = __mmask16((1u << (K - k)) - 1u);
    __m512 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = _mm512_maskz_loadu_ps(m, w + c * K + k);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * sx + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm512_mask_add_ps(acc[c][r], m, acc[c][r], _mm512_mul_ps(xv, wv[c]));
    }
  }
  alignas(64) float l[kLanes];
  for (int c = 0; c < NC; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_store_ps(l, acc[c][r]);
      y[r * sy + c] = fold_lanes(l);
    }
}
#endif

bool f32_vector() {
#ifdef EM_X86
  return em_cpu::features().avx512f;
#else
  return false;
#endif
}

void linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out, bool vector) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "linear_f32: expected fp32 x, w, out; found ", x.scalar_type(), ", ", w.scalar_type(), ", ",
              out.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "linear_f32: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), "x: expected [M, K] with unit stride along K, "
              "found ", x.sizes(), " strides ", x.strides());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous(), "w: expected a contiguous [N, ", K,
              "] tensor, found ", w.sizes());
  const int64_t N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              "out: expected a contiguous [", M, ", ", N, "] tensor");
  TORCH_CHECK(!vector || f32_vector(), "linear_f32: this CPU has no AVX-512");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t sx = x.stride(0), blocks = (M + kF32Rows - 1) / kF32Rows;
  const int64_t col_blocks = (N + kF32Cols - 1) / kF32Cols;
  // (column block, row block) items, a few per thread chunk (a one-row call over both threads: the weight comes
  // from memory, and two threads keep twice the misses in flight: 157 vs 180 us cold for 64 x 1024)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, K * kF32Rows * kF32Cols));
  at::parallel_for(0, col_blocks * blocks, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = (i / blocks) * kF32Cols, b = i % blocks;
      const int64_t m0 = b * kF32Rows, rows = std::min<int64_t>(kF32Rows, M - m0);
      const int64_t cols = std::min<int64_t>(kF32Cols, N - n);
#ifdef EM_X86
      if (vector) {
        if (cols == kF32Cols) {
          f32_block_avx512<kF32Cols>(xp + m0 * sx, sx, wp + n * K, K, yp + m0 * N + n, N, rows);
        } else {
          for (int64_t c = 0; c < cols; ++c)
            f32_block_avx512<1>(xp + m0 * sx, sx, wp + (n + c) * K, K, yp + m0 * N + n + c, N, rows);
        }
        continue;
      }
#endif
      for (int64_t c = 0; c < cols; ++c)
        f32_rows_portable(xp + m0 * sx, sx, wp + (n + c) * K, K, yp + m0 * N + n + c, N, rows);
    }
  });
}

int64_t best_isa() { return resolve_isa(kAuto); }

bool isa_runs(int64_t isa) {
  try {
    resolve_isa(isa);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace

TORCH_LIBRARY(expertmesh_linear_cpu, m) {
  m.def("linear(Tensor x, Tensor w_packed, int N, int K, Tensor(a!) out, int isa) -> ()", &linear);
  m.def("bmm(Tensor x, Tensor w, Tensor(a!) out, int isa) -> ()", &bmm);
  m.def("bmm_packed(Tensor x, Tensor w_packed, int N, int K, Tensor(a!) out, int isa) -> ()", &bmm_packed);
  m.def("best_isa() -> int", &best_isa);
  m.def("isa_runs(int isa) -> bool", &isa_runs);
  m.def("linear_f32(Tensor x, Tensor w, Tensor(a!) out, bool vector) -> ()", &linear_f32);
  m.def("f32_vector() -> bool", &f32_vector);
}
