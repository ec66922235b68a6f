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
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EM_X86 1
#endif

namespace {

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx512Bf16 = 3 };

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
// Software prefetch on the packed weight stream, K pairs ahead, in the first row tile of a work item only (the one
// that streams the column group from memory; the later tiles find it in L2, where extra prefetches only cost).
constexpr int64_t kPrefetchPairs = 8;

EM_TARGET inline __m256i round_to_bf16(__m512 a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

EM_TARGET inline __mmask32 mask32(int64_t n) {  // the first n (clamped to 0..32) of 32 lanes
  return n >= 32 ? __mmask32(0xFFFFFFFFu) : (n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1u));
}

EM_TARGET inline __m512i bcast_pair(const uint16_t* x) {
  uint32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_set1_epi32(int(v));
}

// The weight operand of K pair p for the 64 columns: four vectors of (even, odd) bf16 pairs.
template <bool PACKED, bool PREFETCH>
EM_TARGET inline void load_pair(__m512i* v, const uint16_t* w, int64_t ldw, __mmask32 m0, __mmask32 m1,
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
EM_TARGET inline void load_last_row(__m512i* v, const uint16_t* r0, __mmask32 m0, __mmask32 m1) {
  const __m512i a0 = _mm512_maskz_loadu_epi16(m0, r0), a1 = _mm512_maskz_loadu_epi16(m1, r0 + 32);
  const __m512i z = _mm512_setzero_si512();
  v[0] = _mm512_unpacklo_epi16(a0, z);
  v[1] = _mm512_unpackhi_epi16(a0, z);
  v[2] = _mm512_unpacklo_epi16(a1, z);
  v[3] = _mm512_unpackhi_epi16(a1, z);
}

EM_TARGET void pack_group_avx512(const uint16_t* w, int64_t ldw, int64_t ncols, int64_t K, uint16_t* buf) {
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
  // columns 16c .. 16c+15 of the group. kn: vector 2h holds columns 32h + {0-3, 8-11, 16-19, 24-27} and vector
  // 2h+1 columns 32h + {4-7, 12-15, 20-23, 28-31} (unpack works inside 128-bit lanes): put them back in order.
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
#endif

int64_t resolve_isa(int64_t isa) {
#ifdef EM_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  if (isa == kAuto) return has ? kAvx512Bf16 : kPortable;
  TORCH_CHECK(isa == kPortable || isa == kAvx512Bf16, "row-invariant linear: unknown isa code ", isa);
  TORCH_CHECK(isa != kAvx512Bf16 || has, "row-invariant linear: this CPU has no AVX512-BF16");
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

template <bool PACKED>
void run_tile(int64_t isa, const Tile& t, int mr, int64_t K, bool stream) {
#ifdef EM_X86
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
  if (isa == kAvx512Bf16) return pack_group_avx512(w, ldw, ncols, K, buf);
#endif
  pack_group_portable(w, ldw, ncols, K, buf);
}

// Every (batch item, column group, row chunk) is one work item; a thread runs whole items. x/y/w: base pointers
// and strides in elements.
struct Gemm {
  const uint16_t* x;
  int64_t sxb, sxm;
  const uint16_t* w;
  int64_t swb, ldw;  // packed: swb = group stride is computed; kn: batch stride and K-row stride
  uint16_t* y;
  int64_t syb, sym;
  int64_t B, M, N, K;
};

template <bool PACKED>
void run_gemm(int64_t isa, const Gemm& g) {
  const int64_t G = (g.N + kCols - 1) / kCols;
  const int64_t Kp = g.K + (g.K & 1);
  // rows per work item: all of them for decode-sized M (one pass over the weight), else chunks of 16 tiles so
  // both threads have work and a column group's weight stays in cache across its row tiles.
  const int64_t MC = g.M <= 16 * kMR ? g.M : 16 * kMR;
  const int64_t MCn = (g.M + MC - 1) / MC;
  const int64_t items = g.B * G * MCn;
  // kn weights and more than one row tile per item: the item packs its column group once (into a per-thread
  // buffer, K x 128 bytes) and runs the packed tiles on it — the same pairs in the same order, so the same bits.
  const bool repack = !PACKED && MC > kMR;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> buf(repack ? size_t(Kp / 2) * 2 * kCols : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t mc = i % MCn, gi = (i / MCn) % G, b = i / (MCn * G);
      Tile t;
      t.w = PACKED ? g.w + gi * (Kp / 2) * (2 * kCols) : g.w + b * g.swb + gi * kCols;
      t.ldw = g.ldw;
      t.ncols = std::min<int64_t>(kCols, g.N - gi * kCols);
      if (repack) {
        pack_group(isa, t.w, t.ldw, t.ncols, g.K, buf.data());
        t.w = buf.data();
      }
      const int64_t m_end = std::min(g.M, (mc + 1) * MC);
      for (int64_t m = mc * MC; m < m_end; m += kMR) {
        const int mr = int(std::min<int64_t>(kMR, m_end - m));
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
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  Gemm g{cptr(x), 0, x.stride(0), cptr(w), 0, 0, mptr(out), 0, N, 1, M, N, K};
  run_gemm<true>(resolve_isa(isa), g);
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

int64_t best_isa() { return resolve_isa(kAuto); }

}  // namespace

TORCH_LIBRARY(expertmesh_linear_cpu, m) {
  m.def("linear(Tensor x, Tensor w_packed, int N, int K, Tensor(a!) out, int isa) -> ()", &linear);
  m.def("bmm(Tensor x, Tensor w, Tensor(a!) out, int isa) -> ()", &bmm);
  m.def("best_isa() -> int", &best_isa);
}
