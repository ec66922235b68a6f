// Fused MXFP4 GEMV/GEMM and grouped MoE expert GEMM for CPUs (one translation unit, built on first use by
// expertmesh/kernels/moe/cpu_kernel.py with torch.utils.cpp_extension.load).
//
// Weights stay packed: each 32-block (16 bytes of E2M1 nibbles + one E8M0 scale) is decoded in registers through
// a 16-entry table and its scale applied once to the block's partial dot product. The table holds TWICE the E2M1
// values (0, 1, 2, 3, 4, 6, 8, 12 and negatives: small integers, so AVX2 can decode with one byte shuffle) and the
// scale table 2^(s - 128), half the E8M0 value: (2v)·x is exactly 2·(v·x) and 2^(s-128) halves it back exactly,
// barring fp32 overflow / underflow. Code 8 (-0) decodes as +0: in this order a zero's sign never reaches a result
// (every accumulator starts at +0, and +0 + -0 = +0).
//
// The reduction order of every output element is fixed (and the same on every ISA path, so AVX-512, AVX2 and the
// portable loop give the same bits): 16 lanes; lane l of block b takes the element pair (32b + 2l, 32b + 2l + 1):
//     p = v[2l] * x[2l];  p = fma(v[2l+1], x[2l+1], p);  acc[l] = fma(p, scale_b, acc[l])   for b = 0, 1, ...
// then acc[l] += acc[l+8], acc[l] += acc[l+4], acc[l] += acc[l+2], acc[l] += acc[l+1]; the result is acc[0].
// (v: the doubled table value, scale_b: 2^(s_b - 128).) It depends on nothing but the row and the token: not on how many rows or tokens a call has, the tiling, or the
// thread count (threads split output rows with at::parallel_for). bf16 activations on AVX512-BF16 CPUs take the same
// per-lane operations through the bf16 dot-product instruction (tile_avx512bf16: the same bits). Activations are first rearranged per 32-block
// to [even elements | odd elements] so the pairs line up with the low/high nibbles.
//
// One more path, isa amx (bf16 activations on AMX-BF16 CPUs), sums in the tile unit's order instead: see "AMX" below.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_features.h"  // kernels/cpu/: EM_X86, EM_AMX, em_cpu::features(), em_cpu::amx_usable()

namespace {

alignas(64) const float kE2M1x2[16] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f,
                                       0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f};

struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int s = 0; s < 255; ++s) v[s] = std::ldexp(1.0f, s - 128);  // 2^-128 is an fp32 subnormal: exact
    v[255] = std::numeric_limits<float>::quiet_NaN();
  }
};
const ScaleTable kScale;

// A work buffer every element of which is written before it is read: not zeroed (a prefill call's buffers are
// megabytes; std::vector would clear them first).
template <typename T>
std::unique_ptr<T[]> scratch(size_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

inline uint16_t round_bf16(float f) {  // round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4, kAmx = 5 };

// One call computes R weight rows x TM activation rows. w: R row pointers to packed bytes (K/2 each), s: R scale
// rows (K/32), x: TM rearranged activation rows (K each), y[r*ystride_r + t*ystride_t] = result.
struct Tile {
  const uint8_t* w[2];
  const uint8_t* s[2];
  const float* x[4];
  float* y[2][4];
};

inline void lane_tree(float* a) {  // a[16] -> a[0]
  for (int h = 8; h >= 1; h >>= 1)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
}

template <int R, int TM>
void tile_portable(const Tile& t, int64_t nblocks) {
  float acc[R][TM][16];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m)
      for (int l = 0; l < 16; ++l) acc[r][m][l] = 0.0f;
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = t.w[r] + 16 * b;
      const float sc = kScale.v[t.s[r][b]];
      for (int l = 0; l < 16; ++l) {
        const float ve = kE2M1x2[wb[l] & 15], vo = kE2M1x2[wb[l] >> 4];
        for (int m = 0; m < TM; ++m) {
          const float* xb = t.x[m] + 32 * b;
          float p = ve * xb[l];
          p = std::fma(vo, xb[16 + l], p);
          acc[r][m][l] = std::fma(p, sc, acc[r][m][l]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) {
      lane_tree(acc[r][m]);
      *t.y[r][m] = acc[r][m][0];
    }
}

#ifdef EM_X86
constexpr int64_t kPrefetch = 1024;  // bytes ahead on each weight row (software prefetch, one line per 4 blocks)

template <int R, int TM>
__attribute__((target("avx2,fma"))) void tile_avx2(const Tile& t, int64_t nblocks) {
  // byte shuffle of the doubled table (as int8), then int8 -> int32 -> fp32 in two halves of 8 lanes
  const __m128i tab = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i lo4 = _mm_set1_epi8(15);
  __m256 acc[R][TM][2];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int r = 0; r < R; ++r) {
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(t.w[r] + 16 * b + kPrefetch), _MM_HINT_T0);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w[r] + 16 * b));
      const __m256 sc = _mm256_set1_ps(kScale.v[t.s[r][b]]);
      const __m128i e8 = _mm_shuffle_epi8(tab, _mm_and_si128(bytes, lo4));
      const __m128i o8 = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(bytes, 4), lo4));
      const __m256 ve[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e8)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e8, 8)))};
      const __m256 vo[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(o8)),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(o8, 8)))};
      for (int h = 0; h < 2; ++h) {  // lanes 8h .. 8h+7
        for (int m = 0; m < TM; ++m) {
          const float* xb = t.x[m] + 32 * b + 8 * h;
          __m256 p = _mm256_mul_ps(ve[h], _mm256_loadu_ps(xb));
          p = _mm256_fmadd_ps(vo[h], _mm256_loadu_ps(xb + 16), p);
          acc[r][m][h] = _mm256_fmadd_ps(p, sc, acc[r][m][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) {
      const __m256 a8 = _mm256_add_ps(acc[r][m][0], acc[r][m][1]);                          // l + (l+8)
      const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));  // + (l+4)
      const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));                                // + (l+2)
      const __m128 a1 = _mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1));                            // + (l+1)
      *t.y[r][m] = _mm_cvtss_f32(a1);
    }
}

// The 16 lanes folded as lane_tree does: l + (l+8), + (l+4), + (l+2), + (l+1).
__attribute__((target("avx512f"))) inline float lane_tree512(__m512 a) {
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
  const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
  return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

template <int R, int TM>
__attribute__((target("avx512f"))) void tile_avx512(const Tile& t, int64_t nblocks) {
  const __m512 tab = _mm512_loadu_ps(kE2M1x2);
  const __m512i lo4 = _mm512_set1_epi32(15);
  __m512 acc[R][TM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = t.w[r] + 16 * b;
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch), _MM_HINT_T0);
      const __m512 sc = _mm512_set1_ps(kScale.v[t.s[r][b]]);
      const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
      const __m512 ve = _mm512_permutexvar_ps(_mm512_and_si512(code, lo4), tab);
      const __m512 vo = _mm512_permutexvar_ps(_mm512_srli_epi32(code, 4), tab);
      for (int m = 0; m < TM; ++m) {
        const float* xb = t.x[m] + 32 * b;
        __m512 p = _mm512_mul_ps(ve, _mm512_loadu_ps(xb));
        p = _mm512_fmadd_ps(vo, _mm512_loadu_ps(xb + 16), p);
        acc[r][m] = _mm512_fmadd_ps(p, sc, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) *t.y[r][m] = lane_tree512(acc[r][m]);
}

// bf16 activations (AVX512-BF16): the same per-lane operations as tile_avx512 with x read as bf16 pairs. A lane's
// pair product sum v_e x_e + v_o x_o is one dot-product instruction into +0; both products are exact in fp32 (x has
// 8 significant bits, the doubled table values at most 4), so its one rounding is the FMA path's one rounding and
// the bits are the same as converting x to fp32 first — barring fp32 subnormals, which the instruction flushes to
// zero (|x| below 2^-126: not an activation). x stays in its own layout: lane l's pair (2l, 2l+1) is adjacent.
alignas(64) const uint32_t kE2M1x2Bf16[16] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
                                              0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};

struct TileBf16 {
  const uint8_t* w[2];
  const uint8_t* s[2];
  const uint16_t* x[8];
  float* y[2][8];
};

template <int R, int TM>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_avx512bf16(const TileBf16& t, int64_t nblocks) {
  const __m512i tlo = _mm512_loadu_si512(kE2M1x2Bf16);       // bf16 bits in each dword's low half
  const __m512i thi = _mm512_slli_epi32(tlo, 16);            // ... and in its high half
  const __m512i lo4 = _mm512_set1_epi32(15);
  __m512 acc[R][TM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = t.w[r] + 16 * b;
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch), _MM_HINT_T0);
      const __m512 sc = _mm512_set1_ps(kScale.v[t.s[r][b]]);
      const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
      const __m512i pair = _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_and_si512(code, lo4), tlo),
                                           _mm512_permutexvar_epi32(_mm512_srli_epi32(code, 4), thi));
      for (int m = 0; m < TM; ++m) {
        const __m512i xb = _mm512_loadu_si512(t.x[m] + 32 * b);
        const __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)pair, (__m512bh)xb);
        acc[r][m] = _mm512_fmadd_ps(p, sc, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < TM; ++m) *t.y[r][m] = lane_tree512(acc[r][m]);
}

template <int R>
void run_tile_bf16(int tm, const TileBf16& t, int64_t nblocks) {
  switch (tm) {
    case 1: return tile_avx512bf16<R, 1>(t, nblocks);
    case 2: return tile_avx512bf16<R, 2>(t, nblocks);
    case 3: return tile_avx512bf16<R, 3>(t, nblocks);
    case 4: return tile_avx512bf16<R, 4>(t, nblocks);
    case 5: return tile_avx512bf16<R, 5>(t, nblocks);
    case 6: return tile_avx512bf16<R, 6>(t, nblocks);
    case 7: return tile_avx512bf16<R, 7>(t, nblocks);
    default: return tile_avx512bf16<R, 8>(t, nblocks);
  }
}

// gemm_rows for bf16 activation rows (not rearranged) on the AVX512-BF16 path.
void gemm_rows_bf16(const uint8_t* wb, const uint8_t* ws, int64_t K, const uint16_t* const* x, int64_t M,
                    float* const* yrow, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / 32;
  for (int64_t n = n0; n < n1;) {
    const int r = (n + 1 < n1) ? 2 : 1;
    for (int64_t m = 0; m < M;) {
      const int tm = int(std::min<int64_t>(8, M - m));
      TileBf16 t;
      for (int i = 0; i < r; ++i) {
        t.w[i] = wb + (n + i) * (K / 2);
        t.s[i] = ws + (n + i) * nblocks;
        for (int j = 0; j < tm; ++j) t.y[i][j] = yrow[m + j] + n + i;
      }
      for (int j = 0; j < tm; ++j) t.x[j] = x[m + j];
      if (r == 2) run_tile_bf16<2>(tm, t, nblocks);
      else run_tile_bf16<1>(tm, t, nblocks);
      m += tm;
    }
    n += r;
  }
}
#endif


#ifdef EM_AMX
// ------------------------------------------------------------------------------------------------------ AMX
// isa amx (bf16 activations only): a DIFFERENT reduction order from the paths above, the tile unit's. Each 32-block
// of a weight row is decoded to bf16 with its scale folded in — v * 2^(s - 127), the exact MXFP4 value (a value
// with at most 2 significant bits times a power of two: exact in bf16 unless it overflows to inf, scale 0xFF gives
// NaN) — and the sum is what TDPBF16PS computes (kernels/linear/naive.py matmul_in_tile_order): per 32-block, the
// even products and the odd products summed apart in fp32 from +0 in pair order, the accumulator (from +0) taking
// c = c + (S_even + S_odd); subnormal inputs read as zero, subnormal results flushed. The expert MLP's activation
// h is rounded to bf16 (nearest even) before the down projection. Every call runs on the tile unit, whatever its
// rows: weight rows are the A operand (16 rows x one 32-block per tile, decoded into a buffer), activation rows the
// B operand (16 columns, zero past the call's rows), so a row's bits depend only on its own inputs: not on the
// number of rows, their order or the thread count. The same bits as kernels/moe/naive.py
// moe_expert_outputs_tile_order up to the activation's libm rounding.
constexpr int64_t kTile = 16;  // rows of A, columns of B, pairs per block

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

using em_cpu::amx_usable;

// Every tile 16 rows x 64 bytes: tmm0-3 accumulators (4 groups of 16 activation rows), tmm4 A, tmm5 B.
__attribute__((target("amx-tile"))) inline void amx_configure() {
  AmxConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = uint8_t(kTile);
    cfg.colsb[i] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg));  // the whole 64-byte struct as the operand (see the linear kernel)
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// kFolded.v[s][c]: the bf16 bits of code c's value at scale byte s, v * 2^(s - 127) (a vpermw table; 16 words used).
struct FoldedTable {
  alignas(64) uint16_t v[256][32] = {};
  FoldedTable() {
    for (int s = 0; s < 256; ++s)
      for (int c = 0; c < 16; ++c) {
        const float f = kE2M1x2[c] * kScale.v[s];  // (2v) * 2^(s - 128): exact in fp32 (NaN for s = 255)
        uint32_t u;
        std::memcpy(&u, &f, sizeof u);
        v[s][c] = std::isnan(f) ? uint16_t(0x7FC0) : uint16_t(u >> 16);  // exact in bf16 (<= 2 significant bits)
      }
  }
};
const FoldedTable kFolded;

// Rows [n0, n0 + rows) of an MXFP4 weight (K elements each) decoded into A tiles: dst [K/32][16 rows][32] bf16,
// rows past `rows` zero. One 32-block of a row is 16 dwords of (even, odd) bf16 pairs: byte l's low nibble is
// element 2l, its high nibble element 2l + 1.
__attribute__((target("avx512f,avx512bw"))) void decode_strip(const uint8_t* wb, const uint8_t* ws, int64_t K,
                                                                int64_t n0, int64_t rows, uint16_t* dst) {
  const int64_t nb = K / 32;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);  // word 2l: byte l's low nibble, word 2l + 1: its high one
  for (int64_t r = 0; r < kTile; ++r) {
    if (r >= rows) {
      for (int64_t b = 0; b < nb; ++b) std::memset(dst + (b * kTile + r) * 32, 0, 64);
      continue;
    }
    const uint8_t* w = wb + (n0 + r) * (K / 2);
    const uint8_t* s = ws + (n0 + r) * nb;
    for (int64_t b = 0; b < nb; ++b) {
      if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * (kTile * nb + b)), _MM_HINT_T0);
      const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * b)));
      const __m512i idx = _mm512_and_si512(_mm512_or_si512(code, _mm512_slli_epi32(code, 12)), nibbles);
      _mm512_storeu_si512(dst + (b * kTile + r) * 32, _mm512_permutexvar_epi16(idx, _mm512_load_si512(kFolded.v[s[b]])));
    }
  }
}

// M activation rows (bf16, K each) into B tiles: dst [ceil(M/16)][K/32][16 pairs][16 columns] dwords, column c of
// group g being row 16g + c (zero past M).
void pack_rows(const uint16_t* const* rows, int64_t M, int64_t K, uint32_t* dst) {
  const int64_t nb = K / 32, groups = (M + kTile - 1) / kTile;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t m = g * kTile + c;
      uint32_t* out = dst + g * nb * kTile * kTile + c;
      if (m >= M) {
        for (int64_t i = 0; i < nb * kTile; ++i) out[i * kTile] = 0;
        continue;
      }
      for (int64_t i = 0; i < nb * kTile; ++i) std::memcpy(out + i * kTile, rows[m] + 2 * i, 4);
    }
}

// C[group j][weight row r][column c] = the tile-order sum over K of A row r and B group j column c, NG groups.
template <int NG>
__attribute__((target("amx-tile,amx-bf16"))) void strip_tiles(const uint16_t* a, const uint32_t* b, int64_t nb,
                                                               float* c) {
  const int64_t gstride = nb * kTile * kTile;  // dwords per B group
  _tile_zero(0);
  if constexpr (NG > 1) _tile_zero(1);
  if constexpr (NG > 2) _tile_zero(2);
  if constexpr (NG > 3) _tile_zero(3);
  for (int64_t k = 0; k < nb; ++k) {
    _tile_loadd(4, a + k * kTile * 32, 64);
    const uint32_t* bk = b + k * kTile * kTile;
    _tile_loadd(5, bk, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NG > 1) {
      _tile_loadd(5, bk + gstride, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (NG > 2) {
      _tile_loadd(5, bk + 2 * gstride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NG > 3) {
      _tile_loadd(5, bk + 3 * gstride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NG > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NG > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NG > 3) _tile_stored(3, c + 768, 64);
}

// yrow[m][n] = the tile-order sum of weight row n and activation row m, for rows n in [n0, n0 + 16) ∩ [0, N) and
// the M rows packed in b (pack_rows). a: a strip buffer (K * 16 bf16). Needs amx_configure() on this thread.
void gemm_strip_amx(const uint8_t* wb, const uint8_t* ws, int64_t K, int64_t N, int64_t n0, const uint32_t* b,
                    int64_t M, float* const* yrow, uint16_t* a) {
  const int64_t nb = K / 32, rows = std::min<int64_t>(kTile, N - n0), groups = (M + kTile - 1) / kTile;
  decode_strip(wb, ws, K, n0, rows, a);
  alignas(64) float c[4 * kTile * kTile];
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int ng = int(std::min<int64_t>(4, groups - g0));
    const uint32_t* bg = b + g0 * nb * kTile * kTile;
    switch (ng) {
      case 1: strip_tiles<1>(a, bg, nb, c); break;
      case 2: strip_tiles<2>(a, bg, nb, c); break;
      case 3: strip_tiles<3>(a, bg, nb, c); break;
      default: strip_tiles<4>(a, bg, nb, c); break;
    }
    for (int j = 0; j < ng; ++j)
      for (int64_t col = 0; col < kTile; ++col) {
        const int64_t m = (g0 + j) * kTile + col;
        if (m >= M) break;
        float* y = yrow[m] + n0;
        for (int64_t r = 0; r < rows; ++r) y[r] = c[(j * kTile + r) * kTile + col];
      }
  }
}

// The same sums on the vector units, for experts with 1-8 rows (a tile costs the same for 1 row as for 16 here and
// its weight decode dominates; cold, 4 experts x 8 rows took 0.55 ms this way vs 0.62 ms in tiles, 4 x 3 rows 0.35
// vs 0.48): lanes are 16 weight rows, the even and the odd products of each 32-block summed apart
// by two FMA chains in pair order from +0, then c = c + (S_even + S_odd), with MXCSR DAZ + FTZ as the tile unit
// reads and writes (FlushSubnormals). A weight is (2v) * 2^(s - 128) in fp32, the folded bf16 value exactly (a
// subnormal one is flushed either way); an x * w product is exact in fp32, so each FMA is one rounding as there.
constexpr int64_t kVecRows = 8;  // experts with at most this many rows take the vector path

struct FlushSubnormals {
  unsigned saved;
  FlushSubnormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

// x: the rows widened to fp32 (exact), K each. Lane l reads weight row n0 + l (lanes past `rows` repeat the last
// row); each 32-block's 16 bytes of the 16 rows are loaded whole and transposed in registers into the four vectors
// of one dword per lane (bytes 4q .. 4q + 3: pairs 4q .. 4q + 3) — a gather of the same dwords cost more than the
// arithmetic. A strip's rows are one run of 16 x K/2 bytes and a thread's work items run strip after strip, so
// each block prefetches 4 lines of the next strip: it is in cache when its turn comes (cold weights — 4 random
// experts of 64 a token, a layer at a time — one thread: 0.73 -> 0.46 ms a call with it; gathers and prefetch
// together 1.03 -> 0.46 ms).
template <int MR>
__attribute__((target("avx512f,avx512bw"))) void strip_vec(const uint8_t* wb, const uint8_t* ws, int64_t K,
                                                            int64_t n0, int64_t rows, const float* const* x,
                                                            float* const* y) {
  const int64_t nb = K / 32;
  const uint8_t* row[kTile];
  alignas(64) int32_t soff[kTile];
  for (int64_t l = 0; l < kTile; ++l) {
    const int64_t n = n0 + std::min(l, rows - 1);
    row[l] = wb + n * (K / 2);
    soff[l] = int32_t(n * nb);
  }
  const __m512i vsoff = _mm512_load_si512(soff);
  const uint8_t* next = wb + (n0 + kTile) * (K / 2);  // the next strip (16 rows x K/2 bytes, nb x 4 lines)
  const __m512 tab = _mm512_loadu_ps(kE2M1x2);
  const __m512i lo8 = _mm512_set1_epi32(255);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + 256 * b + 64 * i), _MM_HINT_T0);
    // z[k]: 128-bit lane j = row 4j + k's block; then a 4 x 4 dword transpose inside each 128-bit lane
    __m512i z[4];
    for (int k = 0; k < 4; ++k) {
      z[k] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[k] + 16 * b)));
      z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[4 + k] + 16 * b)), 1);
      z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[8 + k] + 16 * b)), 2);
      z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[12 + k] + 16 * b)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i words[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                              _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const __m512i sidx = _mm512_and_si512(_mm512_i32gather_epi32(vsoff, ws + b, 1), lo8);
    const __m512 vsc = _mm512_i32gather_ps(sidx, kScale.v, 4);
    __m512 se[MR], so[MR];
    for (int m = 0; m < MR; ++m) se[m] = so[m] = _mm512_setzero_ps();
    for (int q = 0; q < 4; ++q) {  // bytes 4q .. 4q + 3 of the block in every row: pairs 4q .. 4q + 3
      for (int j = 0; j < 4; ++j) {
        const int64_t p = 4 * q + j;
        // vpermps reads only an index's low 4 bits: the nibble needs a shift into place, no mask
        const __m512 we = _mm512_mul_ps(_mm512_permutexvar_ps(j ? _mm512_srli_epi32(words[q], 8 * j) : words[q], tab),
                                        vsc);
        const __m512 wo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(words[q], 8 * j + 4), tab), vsc);
        for (int m = 0; m < MR; ++m) {
          se[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][32 * b + 2 * p]), we, se[m]);
          so[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][32 * b + 2 * p + 1]), wo, so[m]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_add_ps(acc[m], _mm512_add_ps(se[m], so[m]));
  }
  const __mmask16 keep = rows >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1u);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y[m] + n0, keep, acc[m]);
}

void gemm_strip_vec(const uint8_t* wb, const uint8_t* ws, int64_t K, int64_t N, int64_t n0, const float* const* x,
                    int64_t M, float* const* y) {
  const int64_t rows = std::min<int64_t>(kTile, N - n0);
  switch (M) {
    case 1: return strip_vec<1>(wb, ws, K, n0, rows, x, y);
    case 2: return strip_vec<2>(wb, ws, K, n0, rows, x, y);
    case 3: return strip_vec<3>(wb, ws, K, n0, rows, x, y);
    case 4: return strip_vec<4>(wb, ws, K, n0, rows, x, y);
    case 5: return strip_vec<5>(wb, ws, K, n0, rows, x, y);
    case 6: return strip_vec<6>(wb, ws, K, n0, rows, x, y);
    case 7: return strip_vec<7>(wb, ws, K, n0, rows, x, y);
    default: return strip_vec<8>(wb, ws, K, n0, rows, x, y);
  }
}

#endif

int64_t resolve_isa(int64_t isa) {
#ifdef EM_X86
  const em_cpu::Features& f = em_cpu::features();
  const bool has512 = f.avx512f;
  const bool hasbf16 = has512 && f.avx512bw && f.avx512bf16;
  const bool has2 = f.avx2 && f.fma;
  if (isa == kAuto) return hasbf16 ? kAvx512Bf16 : has512 ? kAvx512 : (has2 ? kAvx2 : kPortable);
#ifdef EM_AMX
  TORCH_CHECK(isa != kAmx || (hasbf16 && amx_usable()), "mxfp4 cpu kernel: this CPU (or its operating system) offers "
              "no AMX-BF16");
  if (isa == kAmx) return isa;
#else
  TORCH_CHECK(isa != kAmx, "mxfp4 cpu kernel: AMX needs x86-64 Linux");
#endif
  TORCH_CHECK(isa != kAvx512Bf16 || hasbf16, "mxfp4 cpu kernel: this CPU has no AVX512-BF16");
  TORCH_CHECK(isa != kAvx512 || has512, "mxfp4 cpu kernel: this CPU has no AVX-512F");
  TORCH_CHECK(isa != kAvx2 || has2, "mxfp4 cpu kernel: this CPU has no AVX2+FMA");
  return isa;
#else
  TORCH_CHECK(isa == kAuto || isa == kPortable, "mxfp4 cpu kernel: only the portable path exists on this CPU");
  return kPortable;
#endif
}

template <int R, int TM>
inline void run_tile(int64_t isa, const Tile& t, int64_t nblocks) {
#ifdef EM_X86
  if (isa == kAvx512 || isa == kAvx512Bf16) return tile_avx512<R, TM>(t, nblocks);  // fp32 rows
  if (isa == kAvx2) return tile_avx2<R, TM>(t, nblocks);
#endif
  tile_portable<R, TM>(t, nblocks);
}

template <int R>
inline void run_tile_tm(int64_t isa, int tm, const Tile& t, int64_t nblocks) {
  switch (tm) {
    case 1: return run_tile<R, 1>(isa, t, nblocks);
    case 2: return run_tile<R, 2>(isa, t, nblocks);
    case 3: return run_tile<R, 3>(isa, t, nblocks);
    default: return run_tile<R, 4>(isa, t, nblocks);
  }
}

// yrow[m][n] = sum_k W[n, k] x_m[k] for weight rows n in [n0, n1), m in [0, M). x: M rearranged rows (K each).
void gemm_rows(int64_t isa, const uint8_t* wb, const uint8_t* ws, int64_t K, const float* const* x, int64_t M,
               float* const* yrow, int64_t n0, int64_t n1) {
  const int64_t nblocks = K / 32;
  const int tm_max = isa == kAvx2 ? 2 : 4;  // AVX2 has 16 vector registers
  for (int64_t n = n0; n < n1;) {
    const int r = (n + 1 < n1) ? 2 : 1;
    for (int64_t m = 0; m < M;) {
      const int tm = int(std::min<int64_t>(tm_max, M - m));
      Tile t;
      for (int i = 0; i < r; ++i) {
        t.w[i] = wb + (n + i) * (K / 2);
        t.s[i] = ws + (n + i) * nblocks;
        for (int j = 0; j < tm; ++j) t.y[i][j] = yrow[m + j] + n + i;
      }
      for (int j = 0; j < tm; ++j) t.x[j] = x[m + j];
      if (r == 2) run_tile_tm<2>(isa, tm, t, nblocks);
      else run_tile_tm<1>(isa, tm, t, nblocks);
      m += tm;
    }
    n += r;
  }
}

// src[K] -> dst[K]: per 32-block, even elements then odd elements.
template <typename T>
inline float to_f32(T v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else {
    const uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
}

template <typename T>
inline void rearrange(const T* src, float* dst, int64_t K) {
  for (int64_t b = 0; b < K; b += 32)
    for (int l = 0; l < 16; ++l) {
      dst[b + l] = to_f32(src[b + 2 * l]);
      dst[b + 16 + l] = to_f32(src[b + 2 * l + 1]);
    }
}

constexpr int64_t kRowChunk = 16;  // weight rows per parallel work item

void check_cpu(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dt, name, ": unexpected dtype ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

#ifdef EM_AMX
// The tile unit's GEMM: M bf16 rows xs (K apart) against N MXFP4 weight rows -> y [M, N] fp32, threads over strips
// of 16 weight rows.
void gemm_amx(const uint16_t* xs, int64_t M, int64_t K, const uint8_t* wb, const uint8_t* ws, int64_t N, float* y) {
  std::vector<const uint16_t*> xp(M);
  std::vector<float*> yp(M);
  for (int64_t m = 0; m < M; ++m) {
    xp[m] = xs + m * K;
    yp[m] = y + m * N;
  }
  if (M <= kVecRows) {
    std::vector<float> xf(size_t(M * K));
    std::vector<const float*> xfp(M);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = to_f32(xs[m * K + k]);
      xfp[m] = xf.data() + m * K;
    }
    at::parallel_for(0, (N + kTile - 1) / kTile, 1, [&](int64_t s0, int64_t s1) {
      FlushSubnormals flush;
      for (int64_t s = s0; s < s1; ++s) gemm_strip_vec(wb, ws, K, N, s * kTile, xfp.data(), M, yp.data());
    });
    return;
  }
  const auto packed = scratch<uint32_t>(size_t((M + kTile - 1) / kTile * K * kTile / 2));
  pack_rows(xp.data(), M, K, packed.get());
  at::parallel_for(0, (N + kTile - 1) / kTile, 1, [&](int64_t s0, int64_t s1) {
    std::vector<uint16_t> a(size_t(K * kTile));
    amx_configure();
    for (int64_t s = s0; s < s1; ++s) gemm_strip_amx(wb, ws, K, N, s * kTile, packed.get(), M, yp.data(), a.data());
    amx_release();
  });
}
#endif

// x [M, K] fp32 (bf16 for isa amx), blocks [N, K/2], scales [N, K/32] -> out [M, N] fp32 (preallocated).
void mxfp4_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales, const at::Tensor& out,
                  int64_t isa) {
  check_cpu(x, isa == kAmx ? at::kBFloat16 : at::kFloat, "x");
  check_cpu(blocks, at::kByte, "blocks");
  check_cpu(scales, at::kByte, "scales");
  check_cpu(out, at::kFloat, "out");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % 32 == 0 && blocks.size(1) * 2 == K && scales.size(0) == N && scales.size(1) * 32 == K,
              "mxfp4_linear: shapes do not match");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "mxfp4_linear: out shape");
  if (M == 0 || N == 0) return;
  isa = resolve_isa(isa);
#ifdef EM_AMX
  if (isa == kAmx) {
    return gemm_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, blocks.data_ptr<uint8_t>(),
                    scales.data_ptr<uint8_t>(), N, out.data_ptr<float>());
  }
#endif
  std::vector<float> xr(M * K);
  std::vector<const float*> xp(M);
  std::vector<float*> yp(M);
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    rearrange(xs + m * K, xr.data() + m * K, K);
    xp[m] = xr.data() + m * K;
    yp[m] = y + m * N;
  }
  const uint8_t* wb = blocks.data_ptr<uint8_t>();
  const uint8_t* ws = scales.data_ptr<uint8_t>();
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    gemm_rows(isa, wb, ws, K, xp.data(), M, yp.data(), c0 * kRowChunk, std::min(N, c1 * kRowChunk));
  });
}

enum Act : int64_t { kSwiglu = 0, kSitu = 1 };

// The AMX path's gated activation of gate_up [2I] (gate | up) into dst [I], one element at a time with the scalar
// libm functions: the same code and bits for every row whatever the batch (the vector paths: `vact` below).
//   swiglu: silu(g) * u = g / (1 + exp(-g)) * u
//   situ:   a = beta * tanh(g / beta); a = a * (1 / (1 + exp(-g))); u' = lb * tanh(u / lb) (u when lb == 0); a * u'
void gated_act(const float* g, float* dst, int64_t I, int64_t act, float beta, float lb) {
  if (act == kSwiglu) {
    for (int64_t j = 0; j < I; ++j) {
      const float gj = g[j];
      const float s = gj / (1.0f + std::exp(-gj));
      dst[j] = s * g[I + j];
    }
    return;
  }
  for (int64_t j = 0; j < I; ++j) {
    const float gj = g[j];
    float a = beta * std::tanh(gj / beta);
    a = a * (1.0f / (1.0f + std::exp(-gj)));  // exp overflows to inf for gj < -88: sigma = 0, as it should
    float u = g[I + j];
    if (lb > 0.0f) u = lb * std::tanh(u / lb);
    dst[j] = a * u;
  }
}

// The vector paths' activation (isa avx512 / avx512bf16 / avx2 / portable; the AMX path keeps `gated_act`): the
// same function as `gated_act` with exp and tanh computed here instead of by libm, in operations every path runs
// alike — each +, -, *, / one IEEE fp32 rounding (no FMA: -ffp-contract=off), rint to nearest even, exponent bits set
// directly — so the scalar loop, AVX2 (8 lanes) and AVX-512 (16 lanes) give the same bits, and a row's bits never
// depend on the batch. exp: Cephes expf (n = rint(x·log2 e); r = x − n·C1 − n·C2; a degree-5 polynomial in r; times
// 2^n), +inf above 88 (n stays ≤ 127; e^88 ≈ 1.7e38), 0 below −87.337 (2^−126); tanh: Cephes tanhf (an odd polynomial
// below 0.625, else 1 − 2/(exp(2|x|) + 1), the sign copied back). Both within a few ulp of the exact values
// (tests/kernels/test_moe_cpu_kernel.py). libm's scalar calls took ~30% of a 500-token SiTU call.
namespace vact {
constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kHi = 88.0f, kLo = -87.3365447505531f;  // n stays in [-126, 127]
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
constexpr float kT0 = -5.70498872745e-3f, kT1 = 2.06390887954e-2f, kT2 = -5.37397155531e-2f,
                kT3 = 1.33314422036e-1f, kT4 = -3.33332819422e-1f, kTSmall = 0.625f;

inline float bits_to_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t f_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float exp_s(float x) {
  const float xc = x > kLo ? (x < kHi ? x : kHi) : kLo;  // maxps / minps: a NaN x becomes a bound here
  const float n = std::nearbyint(xc * kLog2e);
  float r = xc - n * kC1;
  r = r - n * kC2;
  const float z = r * r;
  float p = kP0 * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  const float y = ((p * z) + r) + 1.0f;
  float out = y * bits_to_f(uint32_t(int32_t(n) + 127) << 23);
  if (x > kHi) out = std::numeric_limits<float>::infinity();
  if (x < kLo) out = 0.0f;
  return x == x ? out : x;  // NaN in, NaN out
}

inline float tanh_s(float x) {
  const float z = bits_to_f(f_to_bits(x) & 0x7FFFFFFFu);
  float t;
  if (z < kTSmall) {
    const float s = x * x;
    float p = kT0 * s + kT1;
    p = p * s + kT2;
    p = p * s + kT3;
    p = p * s + kT4;
    t = p * s * x + x;
  } else {
    t = 1.0f - 2.0f / (exp_s(z + z) + 1.0f);
    t = bits_to_f(f_to_bits(t) | (f_to_bits(x) & 0x80000000u));
  }
  return t;
}

// dst[j] = act(g[j], up[j]) for j0 <= j < n, the order of `gated_act`'s operations.
inline void act_s(const float* g, const float* up, float* dst, int64_t j0, int64_t n, int64_t act, float beta,
                  float lb) {
  for (int64_t j = j0; j < n; ++j) {
    const float gj = g[j];
    const float e = exp_s(0.0f - gj);
    if (act == kSwiglu) {
      dst[j] = (gj / (1.0f + e)) * up[j];
      continue;
    }
    float a = beta * tanh_s(gj / beta);
    a = a * (1.0f / (1.0f + e));
    float u = up[j];
    if (lb > 0.0f) u = lb * tanh_s(u / lb);
    dst[j] = a * u;
  }
}

#ifdef EM_X86
// The same operations on W lanes: exp_v, tanh_v and act_v written once over the vector type VF, the intrinsics'
// prefix P and width BITS (P##add_ps is _mm512_add_ps or _mm256_add_ps), and the three operations whose names differ
// (RINT, CMP, BLEND); expanded for AVX-512 in namespace v512 and for AVX2 in v256.
#define EM_VACT_FUNCS(TARGET, VF, P, BITS, RINT, CMP, BLEND)                                                          \
  __attribute__((target(TARGET))) inline VF exp_v(VF x) {                                                             \
    const VF xc = P##min_ps(P##max_ps(x, P##set1_ps(kLo)), P##set1_ps(kHi));                                          \
    const VF n = RINT(P##mul_ps(xc, P##set1_ps(kLog2e)));                                                             \
    VF r = P##sub_ps(xc, P##mul_ps(n, P##set1_ps(kC1)));                                                              \
    r = P##sub_ps(r, P##mul_ps(n, P##set1_ps(kC2)));                                                                  \
    const VF z = P##mul_ps(r, r);                                                                                     \
    VF p = P##add_ps(P##mul_ps(P##set1_ps(kP0), r), P##set1_ps(kP1));                                                 \
    p = P##add_ps(P##mul_ps(p, r), P##set1_ps(kP2));                                                                  \
    p = P##add_ps(P##mul_ps(p, r), P##set1_ps(kP3));                                                                  \
    p = P##add_ps(P##mul_ps(p, r), P##set1_ps(kP4));                                                                  \
    p = P##add_ps(P##mul_ps(p, r), P##set1_ps(kP5));                                                                  \
    const VF y = P##add_ps(P##add_ps(P##mul_ps(p, z), r), P##set1_ps(1.0f));                                          \
    const VF scale = P##castsi##BITS##_ps(P##slli_epi32(P##add_epi32(P##cvtps_epi32(n), P##set1_epi32(127)), 23));    \
    VF out = P##mul_ps(y, scale);                                                                                     \
    out = BLEND(out, P##set1_ps(std::numeric_limits<float>::infinity()), CMP(x, P##set1_ps(kHi), _CMP_GT_OQ));        \
    out = BLEND(out, P##set1_ps(0.0f), CMP(x, P##set1_ps(kLo), _CMP_LT_OQ));                                          \
    return BLEND(x, out, CMP(x, x, _CMP_EQ_OQ));                                                                      \
  }                                                                                                                   \
  __attribute__((target(TARGET))) inline VF tanh_v(VF x) {                                                            \
    const VF sign = P##castsi##BITS##_ps(P##set1_epi32(int32_t(0x80000000u)));                                        \
    const VF z = P##castsi##BITS##_ps(P##andnot_si##BITS(P##castps_si##BITS(sign), P##castps_si##BITS(x)));           \
    const VF s = P##mul_ps(x, x);                                                                                     \
    VF p = P##add_ps(P##mul_ps(P##set1_ps(kT0), s), P##set1_ps(kT1));                                                 \
    p = P##add_ps(P##mul_ps(p, s), P##set1_ps(kT2));                                                                  \
    p = P##add_ps(P##mul_ps(p, s), P##set1_ps(kT3));                                                                  \
    p = P##add_ps(P##mul_ps(p, s), P##set1_ps(kT4));                                                                  \
    const VF small = P##add_ps(P##mul_ps(P##mul_ps(p, s), x), x);                                                     \
    const VF one = P##set1_ps(1.0f);                                                                                  \
    VF big = P##sub_ps(one, P##div_ps(P##set1_ps(2.0f), P##add_ps(exp_v(P##add_ps(z, z)), one)));                     \
    const auto sign_bits = P##and_si##BITS(P##castps_si##BITS(x), P##castps_si##BITS(sign));                          \
    big = P##castsi##BITS##_ps(P##or_si##BITS(P##castps_si##BITS(big), sign_bits));                                   \
    return BLEND(big, small, CMP(z, P##set1_ps(kTSmall), _CMP_LT_OQ));                                                \
  }                                                                                                                   \
  __attribute__((target(TARGET))) void act_v(const float* g, const float* up, float* dst, int64_t I, int64_t act,     \
                                             float beta, float lb) {                                                  \
    const VF one = P##set1_ps(1.0f), zero = P##set1_ps(0.0f), vbeta = P##set1_ps(beta), vlb = P##set1_ps(lb);         \
    int64_t j = 0;                                                                                                    \
    for (; j + W <= I; j += W) {                                                                                      \
      const VF gj = P##loadu_ps(g + j);                                                                               \
      VF u = P##loadu_ps(up + j);                                                                                     \
      const VF e = exp_v(P##sub_ps(zero, gj));                                                                        \
      if (act == kSwiglu) {                                                                                           \
        P##storeu_ps(dst + j, P##mul_ps(P##div_ps(gj, P##add_ps(one, e)), u));                                        \
        continue;                                                                                                     \
      }                                                                                                               \
      VF a = P##mul_ps(vbeta, tanh_v(P##div_ps(gj, vbeta)));                                                          \
      a = P##mul_ps(a, P##div_ps(one, P##add_ps(one, e)));                                                            \
      if (lb > 0.0f) u = P##mul_ps(vlb, tanh_v(P##div_ps(u, vlb)));                                                   \
      P##storeu_ps(dst + j, P##mul_ps(a, u));                                                                         \
    }                                                                                                                 \
    act_s(g, up, dst, j, I, act, beta, lb);                                                                           \
  }

#define EM_RINT512(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define EM_CMP512(a, b, op) _mm512_cmp_ps_mask(a, b, op)
#define EM_BLEND512(a, b, m) _mm512_mask_blend_ps(m, a, b)
#define EM_RINT256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define EM_CMP256(a, b, op) _mm256_cmp_ps(a, b, op)
#define EM_BLEND256(a, b, m) _mm256_blendv_ps(a, b, m)
namespace v512 {
constexpr int64_t W = 16;
EM_VACT_FUNCS("avx512f", __m512, _mm512_, 512, EM_RINT512, EM_CMP512, EM_BLEND512)
}  // namespace v512
namespace v256 {
constexpr int64_t W = 8;
EM_VACT_FUNCS("avx2", __m256, _mm256_, 256, EM_RINT256, EM_CMP256, EM_BLEND256)
}  // namespace v256
#undef EM_VACT_FUNCS
#endif

// gate [I], up [I] → dst [I] on `isa`'s vector units (the same bits on each).
void gated_act_vec(int64_t isa, const float* g, const float* up, float* dst, int64_t I, int64_t act, float beta,
                   float lb) {
#ifdef EM_X86
  if (isa == kAvx512 || isa == kAvx512Bf16) return v512::act_v(g, up, dst, I, act, beta, lb);
  if (isa == kAvx2) return v256::act_v(g, up, dst, I, act, beta, lb);
#endif
  act_s(g, up, dst, 0, I, act, beta, lb);
}
}  // namespace vact

#ifdef EM_AMX
// moe_expert_outputs on the tile unit (isa amx). start/slot/active: the (token, slot) pairs sorted by expert.
void moe_amx(const uint16_t* xh, int64_t H, int64_t I, int64_t Kt, const std::vector<int64_t>& start,
             const std::vector<int64_t>& slot, const std::vector<int64_t>& active, const at::Tensor& w13b,
             const at::Tensor& w13s, const at::Tensor& w2b, const at::Tensor& w2s, float* y, int64_t act, float beta,
             float lb) {
  const int64_t V = start.back(), A = int64_t(active.size()), I2 = 2 * I;
  // each active expert's rows packed as B tiles: groups of 16 rows, H (then I) elements each
  std::vector<int64_t> goff(A + 1, 0);  // first 16-row group of each active expert
  for (int64_t i = 0; i < A; ++i) {
    const int64_t e = active[i];
    goff[i + 1] = goff[i] + (start[e + 1] - start[e] + kTile - 1) / kTile;
  }
  std::vector<const uint16_t*> xp(V);
  std::vector<float*> gp(V), yp(V);
  const auto gu = scratch<float>(size_t(V * I2));
  const auto hb = scratch<uint16_t>(size_t(V * I));
  std::vector<const uint16_t*> hp(V);
  for (int64_t v = 0; v < V; ++v) {
    xp[v] = xh + (slot[v] / Kt) * H;
    gp[v] = gu.get() + v * I2;
    hp[v] = hb.get() + v * I;
    yp[v] = y + slot[v] * H;
  }
  const auto packed = scratch<uint32_t>(size_t(goff[A] * std::max(H, I) * kTile / 2));  // tile experts' groups
  const auto wide = scratch<float>(size_t(V * std::max(H, I)));                        // vector experts' rows
  std::vector<const float*> wp(V);
  // each expert's rows as its path reads them: B tiles, or widened to fp32 for the vector path
  auto pack = [&](const std::vector<const uint16_t*>& rows, int64_t K) {
    at::parallel_for(0, A, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t e = active[i], n = start[e + 1] - start[e];
        if (n > kVecRows) {
          pack_rows(rows.data() + start[e], n, K, packed.get() + goff[i] * K * kTile / 2);
          continue;
        }
        for (int64_t v = start[e]; v < start[e + 1]; ++v) {
          float* dst = wide.get() + v * K;
          for (int64_t k = 0; k < K; ++k) dst[k] = to_f32(rows[v][k]);
          wp[v] = dst;
        }
      }
    });
  };
  // work items: (active expert, 16-row strip of the weight)
  auto gemm = [&](const at::Tensor& wb, const at::Tensor& ws, int64_t N, int64_t K, std::vector<float*>& out) {
    const uint8_t* b = wb.data_ptr<uint8_t>();
    const uint8_t* s = ws.data_ptr<uint8_t>();
    const int64_t strips = (N + kTile - 1) / kTile;
    at::parallel_for(0, A * strips, 1, [&](int64_t i0, int64_t i1) {
      std::vector<uint16_t> a(size_t(K * kTile));
      FlushSubnormals flush;
      amx_configure();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = i / strips, e = active[j], v0 = start[e], n = start[e + 1] - v0;
        const uint8_t* be = b + e * N * (K / 2);
        const uint8_t* se = s + e * N * (K / 32);
        if (n <= kVecRows) gemm_strip_vec(be, se, K, N, (i % strips) * kTile, wp.data() + v0, n, out.data() + v0);
        else gemm_strip_amx(be, se, K, N, (i % strips) * kTile, packed.get() + goff[j] * K * kTile / 2, n,
                            out.data() + v0, a.data());
      }
      amx_release();
    });
  };
  pack(xp, H);
  gemm(w13b, w13s, I2, H, gp);
  at::parallel_for(0, V, 16, [&](int64_t v0, int64_t v1) {  // the activation, then h rounded to bf16
    std::vector<float> h(I);
    for (int64_t v = v0; v < v1; ++v) {
      gated_act(gp[v], h.data(), I, act, beta, lb);
      for (int64_t j = 0; j < I; ++j) hb[v * I + j] = round_bf16(h[j]);
    }
  });
  pack(hp, I);
  gemm(w2b, w2s, H, I, yp);
}
#endif

// The grouped expert GEMM: x [T, H] fp32, ids [T, Kt] int64 (local ids, -1 skip), w13 [E, 2I, H/2] (+ scales),
// w2 [E, H, I/2] (+ scales) -> out [T, Kt, H] fp32 (preallocated; skipped slots written as 0). act: 0 SwiGLU,
// 1 SiTU with soft caps beta (> 0) and linear_beta (>= 0; 0 = up not capped), used as fp32.
void moe_expert_outputs(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w13b, const at::Tensor& w13s,
                        const at::Tensor& w2b, const at::Tensor& w2s, const at::Tensor& out, int64_t isa,
                        int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x: expected float32 or bfloat16, found ", x.scalar_type());
  check_cpu(x, x.scalar_type(), "x");
  check_cpu(ids, at::kLong, "topk_ids");
  check_cpu(w13b, at::kByte, "w13_blocks");
  check_cpu(w13s, at::kByte, "w13_scales");
  check_cpu(w2b, at::kByte, "w2_blocks");
  check_cpu(w2s, at::kByte, "w2_scales");
  check_cpu(out, at::kFloat, "out");
  const int64_t T = x.size(0), H = x.size(1), Kt = ids.size(1), E = w13b.size(0), I2 = w13b.size(1), I = I2 / 2;
  TORCH_CHECK(H % 32 == 0 && I % 32 == 0 && w2b.size(1) == H && w2b.size(2) * 2 == I, "moe: shapes do not match");
  TORCH_CHECK(act == kSwiglu || act == kSitu, "activation: expected 0 (swiglu) or 1 (situ), found ", act);
  const float fbeta = static_cast<float>(beta), flb = static_cast<float>(linear_beta);
  TORCH_CHECK(act != kSitu || (std::isfinite(fbeta) && fbeta > 0.0f), "activation: beta must be > 0, found ", beta);
  TORCH_CHECK(std::isfinite(flb) && flb >= 0.0f, "activation: linear_beta must be >= 0, found ", linear_beta);
  float* y = out.data_ptr<float>();
  std::memset(y, 0, sizeof(float) * T * Kt * H);
  const int64_t S = T * Kt;
  if (S == 0 || E == 0) return;
  isa = resolve_isa(isa);
  const int64_t* id = ids.data_ptr<int64_t>();
  // Counting sort of the (token, slot) pairs by expert, slot order kept inside each expert.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < E, "topk_ids: value out of range");
    if (id[i] >= 0) ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t V = start[E];
  if (V == 0) return;
  std::vector<int64_t> slot(V);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < S; ++i)
      if (id[i] >= 0) slot[fill[id[i]]++] = i;
  }
  std::vector<int64_t> active;  // experts with rows
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t A = int64_t(active.size());
#ifdef EM_AMX
  if (isa == kAmx) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x: isa amx takes bfloat16 activations, found ", x.scalar_type());
    return moe_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()), H, I, Kt, start, slot, active, w13b, w13s, w2b,
                   w2s, y, act, fbeta, flb);
  }
#endif

  // bf16 rows go to the AVX512-BF16 tiles as they are; otherwise every row is widened to fp32 and rearranged
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool bf16_tiles = bf16 && isa == kAvx512Bf16;
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  const float* xs = bf16 ? nullptr : x.data_ptr<float>();
  std::vector<float> xr(bf16_tiles ? 0 : V * H), gu(V * I2), hid(V * I);
  std::vector<const float*> xp(V), ap(V);
  std::vector<const uint16_t*> xq(bf16_tiles ? V : 0);
  std::vector<float*> gp(V), yp(V);
  at::parallel_for(0, V, 16, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t row = slot[v] / Kt;
      if (bf16_tiles) xq[v] = xh + row * H;
      else if (bf16) rearrange(xh + row * H, xr.data() + v * H, H);
      else rearrange(xs + row * H, xr.data() + v * H, H);
      xp[v] = bf16_tiles ? nullptr : xr.data() + v * H;
      ap[v] = hid.data() + v * I;
      gp[v] = gu.data() + v * I2;
      yp[v] = y + slot[v] * H;
    }
  });
  // Phase 1: gate_up [V, 2I] = W13_e x for every active expert's rows (work items: expert x 16-row chunk).
  const uint8_t* b13 = w13b.data_ptr<uint8_t>();
  const uint8_t* s13 = w13s.data_ptr<uint8_t>();
  const int64_t c1n = (I2 + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, A * c1n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = active[i / c1n], c = i % c1n, v0 = start[e];
#ifdef EM_X86
      if (bf16_tiles) {
        gemm_rows_bf16(b13 + e * I2 * (H / 2), s13 + e * I2 * (H / 32), H, xq.data() + v0, start[e + 1] - v0,
                       gp.data() + v0, c * kRowChunk, std::min(I2, (c + 1) * kRowChunk));
        continue;
      }
#endif
      gemm_rows(isa, b13 + e * I2 * (H / 2), s13 + e * I2 * (H / 32), H, xp.data() + v0, start[e + 1] - v0,
                gp.data() + v0, c * kRowChunk, std::min(I2, (c + 1) * kRowChunk));
    }
  });
  // The activation (vact: the same bits on every vector path, whatever the batch), then rearranged for phase 2.
  at::parallel_for(0, V, 16, [&](int64_t v0, int64_t v1) {
    std::vector<float> tmp(I);
    for (int64_t v = v0; v < v1; ++v) {
      vact::gated_act_vec(isa, gu.data() + v * I2, gu.data() + v * I2 + I, tmp.data(), I, act, fbeta, flb);
      rearrange(tmp.data(), hid.data() + v * I, I);
    }
  });
  // Phase 2: out[slot] = W2_e act.
  const uint8_t* b2 = w2b.data_ptr<uint8_t>();
  const uint8_t* s2 = w2s.data_ptr<uint8_t>();
  const int64_t c2n = (H + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, A * c2n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = active[i / c2n], c = i % c2n, v0 = start[e];
      gemm_rows(isa, b2 + e * H * (I / 2), s2 + e * H * (I / 32), I, ap.data() + v0, start[e + 1] - v0,
                yp.data() + v0, c * kRowChunk, std::min(H, (c + 1) * kRowChunk));
    }
  });
}

// The canonical group partial sums (kernels/moe/combine.py group_partials): outputs [T, Kt, H] fp32 unweighted
// expert outputs, ids [T, Kt] global ids ascending per row among the valid ones (-1 absent), weights [T, Kt] fp32
// -> [R, H] fp32, one row per (row, group present) in row-major order:
//     P = +0;  P = P + y_k * w_k   for the row's slots of the group in ascending id      (two roundings each)
// the same fp32 operations in the same order as the PyTorch definition, so the same bits.
at::Tensor group_partials(const at::Tensor& outputs, const at::Tensor& ids, const at::Tensor& weights,
                          int64_t group_size) {
  check_cpu(outputs, at::kFloat, "outputs");
  check_cpu(ids, at::kLong, "ids");
  check_cpu(weights, at::kFloat, "weights");
  TORCH_CHECK(outputs.dim() == 3 && ids.dim() == 2 && weights.sizes() == ids.sizes() &&
              outputs.size(0) == ids.size(0) && outputs.size(1) == ids.size(1),
              "group_partials: expected outputs [T, K, H], ids and weights [T, K]");
  TORCH_CHECK(group_size > 0, "group_size: expected > 0, found ", group_size);
  const int64_t T = ids.size(0), Kt = ids.size(1), H = outputs.size(2);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> first(T + 1, 0);  // output row of each token's first group
  for (int64_t t = 0; t < T; ++t) {
    int64_t prev = -1, n = 0;
    for (int64_t k = 0; k < Kt; ++k) {
      const int64_t e = id[t * Kt + k];
      if (e < 0) continue;
      TORCH_CHECK(e > prev, "ids: expected each row's valid ids distinct and ascending");
      if (prev < 0 || e / group_size != prev / group_size) ++n;
      prev = e;
    }
    first[t + 1] = first[t] + n;
  }
  at::Tensor acc = at::empty({first[T], H}, outputs.options());
  acc.zero_();
  const float* y = outputs.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* a = acc.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t r = first[t] - 1, group = -1;
      for (int64_t k = 0; k < Kt; ++k) {
        const int64_t e = id[t * Kt + k];
        if (e < 0) continue;
        if (e / group_size != group) {
          group = e / group_size;
          ++r;
        }
        const float wk = w[t * Kt + k];
        const float* yk = y + (t * Kt + k) * H;
        float* ar = a + r * H;
        for (int64_t d = 0; d < H; ++d) ar[d] = ar[d] + yk[d] * wk;
      }
    }
  });
  return acc;
}

// The routed sum from the P_g rows that arrived (kernels/moe/combine.py fold_rows): rows [R, H] fp32 or bf16 of the
// distinct (token, group) pairs tokens [R], groups [R] -> fp32 [n_tokens, H]: per token, acc = +0, then
// acc = acc + round(P_g) for its groups ascending (round: through bf16 when round_bf16, else none) — the same fp32
// adds in the same order as the definition, so the same bits; threads split tokens.
at::Tensor fold_rows(const at::Tensor& tokens, const at::Tensor& groups, const at::Tensor& rows, int64_t n_tokens,
                     bool round_to_bf16) {
  check_cpu(tokens, at::kLong, "tokens");
  check_cpu(groups, at::kLong, "groups");
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              "rows: expected float32 or bfloat16, found ", rows.scalar_type());
  check_cpu(rows, rows.scalar_type(), "rows");
  TORCH_CHECK(rows.dim() == 2 && tokens.dim() == 1 && groups.sizes() == tokens.sizes() &&
              tokens.size(0) == rows.size(0), "fold_rows: expected rows [R, H], tokens and groups [R]");
  const int64_t R = rows.size(0), H = rows.size(1);
  at::Tensor acc = at::empty({n_tokens, H}, rows.options().dtype(at::kFloat));
  acc.zero_();
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int64_t* gr = groups.data_ptr<int64_t>();
  std::vector<int64_t> start(n_tokens + 1, 0), order(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(tk[r] >= 0 && tk[r] < n_tokens, "tokens: ", tk[r], " outside [0, ", n_tokens, ")");
    ++start[tk[r] + 1];
  }
  for (int64_t t = 0; t < n_tokens; ++t) start[t + 1] += start[t];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < R; ++r) order[fill[tk[r]]++] = r;
  }
  for (int64_t t = 0; t < n_tokens; ++t) {  // each token's rows in ascending group
    std::sort(order.begin() + start[t], order.begin() + start[t + 1],
              [&](int64_t a, int64_t b) { return gr[a] < gr[b]; });
    for (int64_t i = start[t] + 1; i < start[t + 1]; ++i)
      TORCH_CHECK(gr[order[i]] != gr[order[i - 1]], "groups: token ", t, " has two rows of group ", gr[order[i]]);
  }
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  const float* rf = bf16 ? nullptr : rows.data_ptr<float>();
  const uint16_t* rh = bf16 ? reinterpret_cast<const uint16_t*>(rows.data_ptr()) : nullptr;
  float* a = acc.data_ptr<float>();
  at::parallel_for(0, n_tokens, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* at_ = a + t * H;
      for (int64_t i = start[t]; i < start[t + 1]; ++i) {
        const int64_t r = order[i];
        if (bf16) {
          for (int64_t d = 0; d < H; ++d) at_[d] = at_[d] + to_f32(rh[r * H + d]);
        } else if (round_to_bf16) {
          for (int64_t d = 0; d < H; ++d) at_[d] = at_[d] + to_f32(round_bf16(rf[r * H + d]));
        } else {
          for (int64_t d = 0; d < H; ++d) at_[d] = at_[d] + rf[r * H + d];
        }
      }
    }
  });
  return acc;
}

// The vector paths' activation on its own: gate, up [T, I] fp32 (rows contiguous, any row stride) → [T, I] on
// `isa` (the shared experts' and dense MLPs' activation on CPU; tests). Rows split across threads.
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, int64_t isa, int64_t act, double beta,
                            double linear_beta) {
  for (const auto* t : {&gate, &up}) {
    const char* name = t == &gate ? "gate" : "up";
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, name, ": expected a float32 CPU tensor");
    TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1, name, ": expected [T, I] with contiguous rows, found ",
                t->sizes(), " strides ", t->strides());
  }
  TORCH_CHECK(up.sizes() == gate.sizes(), "up: expected the shape of gate ", gate.sizes(), ", found ", up.sizes());
  TORCH_CHECK(act == kSwiglu || act == kSitu, "activation: expected 0 (swiglu) or 1 (situ), found ", act);
  isa = resolve_isa(isa);
  TORCH_CHECK(isa != kAmx, "gated_activation: the AMX path keeps the libm activation (isa amx)");
  const int64_t T = gate.size(0), I = gate.size(1), sg = gate.stride(0), su = up.stride(0);
  at::Tensor out = at::empty({T, I}, gate.options());
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      vact::gated_act_vec(isa, g + t * sg, u + t * su, o + t * I, I, act, float(beta), float(linear_beta));
  });
  return out;
}

int64_t best_isa() { return resolve_isa(kAuto); }

bool amx_runs() {
#ifdef EM_AMX
  const em_cpu::Features& f = em_cpu::features();
  return f.avx512f && f.avx512bw && f.avx512bf16 && amx_usable();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(expertmesh_mxfp4_cpu, m) {
  m.def("mxfp4_linear(Tensor x, Tensor blocks, Tensor scales, Tensor(a!) out, int isa) -> ()", &mxfp4_linear);
  m.def("moe_expert_outputs(Tensor x, Tensor topk_ids, Tensor w13_blocks, Tensor w13_scales, Tensor w2_blocks, "
        "Tensor w2_scales, Tensor(a!) out, int isa, int act, float beta, float linear_beta) -> ()",
        &moe_expert_outputs);
  m.def("group_partials(Tensor outputs, Tensor ids, Tensor weights, int group_size) -> Tensor", &group_partials);
  m.def("fold_rows(Tensor tokens, Tensor groups, Tensor rows, int n_tokens, bool round_bf16) -> Tensor", &fold_rows);
  m.def("gated_activation(Tensor gate, Tensor up, int isa, int act, float beta, float linear_beta) -> Tensor",
        &gated_activation);
  m.def("best_isa() -> int", &best_isa);
  m.def("amx_runs() -> bool", &amx_runs);
}
