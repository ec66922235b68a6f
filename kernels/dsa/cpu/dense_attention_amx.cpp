// Dense (causal) attention over a latent cache on AMX-BF16, for prefill: one translation unit, built on first use by
// expertmesh/kernels/dsa/cpu_kernel.py with torch.utils.cpp_extension.load.
//
// MLA / DSA in the absorbed form is multi-query attention: every head of every query attends over the same rows
// kv[j] (the latent and its rope key, D wide; the values are its first V columns). For query row r (a token t and
// a head; the rows of q [T, H, D] flattened) that sees positions 0 .. vis(r) - 1 (causal: vis = pos(t) + 1, else n):
//     l_j = (q_r . kv_j) * scale                     the tile unit's sum (kernels/linear/naive.matmul_in_tile_order)
//     m = max_j l_j;  e_j = exp(l_j - m)             exp: exp_ps below (within 2 ulp of libm's)
//     s = sum_j e_j                                  16 lanes over j in order (lane l: j = l mod 16), then 8, 4, 2, 1
//     e_j = hi_j + lo_j,  hi_j = bf16(e_j),  lo_j = bf16(e_j - hi_j)   (e to ~16 significant bits: the tile unit
//                                                                       multiplies bf16 only)
//     out[r, c] = (sum_j hi_j kv_j[c] + lo_j kv_j[c]) / s   the tile unit's sum over j, per block of 32 positions
//                                                           the hi products, then the lo products
// fp32 throughout; positions a row does not see take e = 0 (+0 in every sum). Every reduction runs in one order
// fixed by the row's own position and the positions from 0, never by T, n, the other rows or the threads, so a
// query's result is bitwise the same whether its prompt is prefilled in one call or in chunks.
//
// Layout: the 16-row tiles read q rows copied into a zero-padded buffer; kv is packed once per call into the two B
// operands — K^T as [n/16 groups][D/2 pairs][16 positions][2] and V as [n/2 position pairs][Vp][2] — each a few
// hundred KiB for a 1,000-token context, shared by the threads, which split the 16-row blocks.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"  // kernels/cpu/: EM_X86, EM_AMX, em_cpu::features(), em_cpu::amx_usable()

namespace {

#ifdef EM_AMX
#define EM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define EM_TILES __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kRows = 16;    // rows per tile
constexpr int64_t kPairs = 16;   // K pairs per TDPBF16PS
constexpr int64_t kKeys = 16;    // positions per logits tile (its columns)

bool amx_usable() { return em_cpu::features().avx512bf16 && em_cpu::amx_usable(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: accumulators (16 x 16 fp32); tmm4, tmm5: A operands (16 rows x 16 pairs); tmm6: B (16 pairs x 16
// columns); tmm7: B of the last D block of the logits (`tail` pairs), with tmm5 as its A (configured with
// tail = 16 for the values, where tmm4 / tmm5 hold the hi / lo weights).
__attribute__((target("amx-tile"))) void configure(int64_t tail) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = uint8_t(kRows);
    cfg.colsb[i] = 64;
  }
  cfg.colsb[5] = uint16_t(4 * tail);
  cfg.rows[7] = uint8_t(tail);
  asm volatile("ldtilecfg %0" : : "m"(cfg));  // not _tile_loadconfig: GCC 12 lets -O3 drop the config's stores
}

EM_AVX512 inline __m512i bf16_round_ps(__m512 a) {  // 16 floats -> 16 bf16 in the low halves of 32-bit lanes
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
}

// exp(x) for x <= 0: x = k ln2 + r (|r| <= ln2/2, ln2 in two parts), exp(r) by Cephes' degree-6 polynomial,
// times 2^k (vscalefps: k below -126 gives subnormals, then 0).
EM_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

struct Problem {
  const uint16_t* q;    // [B, R, D] (R = T * H rows)
  const uint16_t* kv;   // [B, n, D]
  const int64_t* pos;   // [T] query positions (causal), or nullptr: every position visible
  float* out;           // [B, R, V]
  int64_t B, T, H, n, D, V;
  float scale;
};

// Per call and batch item: kv as the two B operands.
struct Packed {
  int64_t DP, DA, NK, NP, VP;   // D pairs, D padded to whole blocks; positions padded to 32; V padded to 64
  std::vector<uint16_t> k;      // [NK/16][DA/2][16][2]
  std::vector<uint16_t> v;      // [NK/2][VP][2]
};

void pack(const uint16_t* kv, int64_t n, int64_t D, int64_t V, Packed& p) {
  p.DP = (D + 1) / 2;
  p.DA = ((p.DP + kPairs - 1) / kPairs) * kPairs * 2;
  p.NK = ((n + 2 * kPairs - 1) / (2 * kPairs)) * 2 * kPairs;
  p.VP = ((V + 63) / 64) * 64;
  p.k.assign(size_t(p.NK * p.DA), 0);
  p.v.assign(size_t(p.NK * p.VP), 0);
  // each position writes its own elements: the threads split the positions (a 1,000-position cache is ~1 M
  // scattered stores, which on one thread held the other idle before the blocks start)
  at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* row = kv + j * D;
      uint16_t* kg = p.k.data() + (j / kKeys) * (p.DA / 2) * kKeys * 2 + (j % kKeys) * 2;
      for (int64_t d = 0; d < D; ++d) kg[(d / 2) * kKeys * 2 + (d & 1)] = row[d];
      uint16_t* vp = p.v.data() + (j / 2) * p.VP * 2 + (j & 1);
      for (int64_t c = 0; c < V; ++c) vp[2 * c] = row[c];
    }
  });
}

// The i-th block a thread runs: the first, the last, the second, the one before the last, ... Causal blocks grow
// with their position, and at::parallel_for gives each thread a contiguous range of i: in this order every range
// holds short and long blocks alike (in block order the thread with the last half had 3/4 of the work). Which
// thread runs a block does not change its bits.
inline int64_t balanced_block(int64_t i, int64_t blocks) { return (i & 1) ? blocks - 1 - i / 2 : i / 2; }

// One block of up to 16 rows (rows r0 .. r0 + mr - 1 of batch item b).
struct Scratch {
  std::vector<uint16_t> a;        // [16][DA] the rows of q
  std::vector<float> l;           // [16][NK] logits, then e
  std::vector<uint16_t> hi, lo;   // [16][NK]
  alignas(64) float c[kRows * 64];
};

EM_TILES void block(const Problem& pr, const Packed& pk, int64_t tail, int64_t b, int64_t r0, int mr, Scratch& s) {
  const int64_t D = pr.D, V = pr.V, NK = pk.NK, DA = pk.DA;
  int64_t vis[kRows];
  int64_t vmax = 0;
  for (int r = 0; r < kRows; ++r) {
    const int64_t t = (r0 + std::min<int64_t>(r, mr - 1)) / pr.H;
    vis[r] = r < mr ? (pr.pos ? std::min(pr.pos[t] + 1, pr.n) : pr.n) : 0;
    vmax = std::max(vmax, vis[r]);
  }
  for (int r = 0; r < kRows; ++r) {
    uint16_t* row = s.a.data() + r * DA;
    if (r < mr) {
      std::memcpy(row, pr.q + (b * pr.T * pr.H + r0 + r) * D, size_t(D) * 2);
      std::memset(row + D, 0, size_t(DA - D) * 2);
    } else {
      std::memset(row, 0, size_t(DA) * 2);
    }
  }
  // logits: 4 position groups at a time, D in blocks of 16 pairs (the last block: tmm5 x tmm7, `tail` pairs)
  configure(tail);
  const int64_t groups = (vmax + kKeys - 1) / kKeys, dblocks = DA / (2 * kPairs);
  const int64_t kstride = (DA / 2) * kKeys * 2;  // elements per packed position group
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int ng = int(std::min<int64_t>(4, groups - g0));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t db = 0; db < dblocks; ++db) {
      const bool last = db + 1 == dblocks;
      const uint16_t* a = s.a.data() + db * 2 * kPairs;
      const uint16_t* k = pk.k.data() + g0 * kstride + db * kPairs * kKeys * 2;
      // tile numbers are part of the instruction: spelled out per accumulator
#define EM_LOGITS(C)                                              \
  if ((C) < ng) {                                                 \
    if (last) {                                                   \
      _tile_loadd(7, k + (C) * kstride, kKeys * 4);               \
      _tile_dpbf16ps(C, 5, 7);                                    \
    } else {                                                      \
      _tile_loadd(6, k + (C) * kstride, kKeys * 4);               \
      _tile_dpbf16ps(C, 4, 6);                                    \
    }                                                             \
  }
      if (last) _tile_loadd(5, a, DA * 2);
      else _tile_loadd(4, a, DA * 2);
      EM_LOGITS(0)
      EM_LOGITS(1)
      EM_LOGITS(2)
      EM_LOGITS(3)
#undef EM_LOGITS
    }
    float* l = s.l.data() + g0 * kKeys;
    const int64_t ls = NK * 4;
    _tile_stored(0, l, ls);
    if (ng > 1) _tile_stored(1, l + kKeys, ls);
    if (ng > 2) _tile_stored(2, l + 2 * kKeys, ls);
    if (ng > 3) _tile_stored(3, l + 3 * kKeys, ls);
  }
  // softmax weights per row: e = exp(l * scale - m) where visible, else 0; hi / lo parts; the sum in 16 lanes
  const int64_t pblocks = (vmax + 2 * kPairs - 1) / (2 * kPairs);  // blocks of 32 positions
  const int64_t width = pblocks * 2 * kPairs;
  float sum[kRows];
  const __m512 scale = _mm512_set1_ps(pr.scale);
  for (int r = 0; r < kRows; ++r) {
    float* l = s.l.data() + r * NK;
    uint16_t* hi = s.hi.data() + r * NK;
    uint16_t* lo = s.lo.data() + r * NK;
    const int64_t nv = vis[r];
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nv; j += 16) {
      const __mmask16 m = nv - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nv - j)) - 1u);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, l + j), scale);
      _mm512_storeu_ps(l + j, x);
      mx = _mm512_mask_max_ps(mx, m, mx, x);
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));  // max: exact in any order
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 m = nv - j >= 16 ? __mmask16(0xFFFF) : (nv > j ? __mmask16((1u << (nv - j)) - 1u) : 0);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, l + j), mv)));
      acc = _mm512_add_ps(acc, e);
      const __m512i h = bf16_round_ps(e);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
      const __m512i lw = bf16_round_ps(_mm512_sub_ps(e, hf));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), _mm512_cvtepi32_epi16(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), _mm512_cvtepi32_epi16(lw));
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc);
    for (int h = 8; h >= 1; h >>= 1)
      for (int i = 0; i < h; ++i) lanes[i] = lanes[i] + lanes[i + h];
    sum[r] = lanes[0];
  }
  // out = (hi . V + lo . V) / s: 64 value columns at a time, positions in blocks of 32 (16 pairs)
  configure(kPairs);
  for (int64_t c0 = 0; c0 < V; c0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t pb = 0; pb < pblocks; ++pb) {
      _tile_loadd(4, s.hi.data() + pb * 2 * kPairs, NK * 2);
      _tile_loadd(5, s.lo.data() + pb * 2 * kPairs, NK * 2);
      const uint16_t* v = pk.v.data() + pb * kPairs * pk.VP * 2 + c0 * 2;
#define EM_VALUES(C)                                    \
  _tile_loadd(6, v + (C) * 32, pk.VP * 4);              \
  _tile_dpbf16ps(C, 4, 6);                              \
  _tile_dpbf16ps(C, 5, 6);
      EM_VALUES(0)
      EM_VALUES(1)
      EM_VALUES(2)
      EM_VALUES(3)
#undef EM_VALUES
    }
    _tile_stored(0, s.c, 64 * 4);
    _tile_stored(1, s.c + 16, 64 * 4);
    _tile_stored(2, s.c + 32, 64 * 4);
    _tile_stored(3, s.c + 48, 64 * 4);
    const int64_t nc = std::min<int64_t>(64, V - c0);
    for (int r = 0; r < mr; ++r) {
      float* o = pr.out + (b * pr.T * pr.H + r0 + r) * V + c0;
      for (int64_t c = 0; c < nc; ++c) o[c] = s.c[r * 64 + c] / sum[r];
    }
  }
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

void run(const Problem& pr) {
  const int64_t R = pr.T * pr.H, blocks = (R + kRows - 1) / kRows;
  for (int64_t b = 0; b < pr.B; ++b) {
    Packed pk;
    pack(pr.kv + b * pr.n * pr.D, pr.n, pr.D, pr.V, pk);
    const int64_t tail = pk.DP - (pk.DA / (2 * kPairs) - 1) * kPairs;
    at::parallel_for(0, blocks, 1, [&](int64_t i0, int64_t i1) {
      Scratch s;
      s.a.assign(size_t(kRows * pk.DA), 0);
      s.l.assign(size_t(kRows * pk.NK), 0.0f);
      s.hi.assign(size_t(kRows * pk.NK), 0);
      s.lo.assign(size_t(kRows * pk.NK), 0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t k = balanced_block(i, blocks);
        block(pr, pk, tail, b, k * kRows, int(std::min<int64_t>(kRows, R - k * kRows)), s);
      }
      release();
    });
  }
}
#endif

bool runs() {
#ifdef EM_AMX
  return amx_usable();
#else
  return false;
#endif
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected ", dtype, ", found ", t.scalar_type());
}

// q [B, T, H, D] bf16, kv [B, n, D] bf16, q_pos [T] int64 (causal; empty: every position visible),
// out [B, T, H, V] fp32 (preallocated), V <= D.
void dense_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& q_pos, double scale,
                     const at::Tensor& out) {
  check(q, "q", at::kBFloat16);
  check(kv, "kv", at::kBFloat16);
  check(q_pos, "q_pos", at::kLong);
  check(out, "out", at::kFloat);
  TORCH_CHECK(q.dim() == 4 && kv.dim() == 3 && out.dim() == 4, "dense_attention: expected q [B,T,H,D], kv [B,n,D], "
              "out [B,T,H,V]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), n = kv.size(1), V = out.size(3);
  TORCH_CHECK(kv.size(0) == B && kv.size(2) == D, "kv: expected [", B, ", n, ", D, "], found ", kv.sizes());
  TORCH_CHECK(out.size(0) == B && out.size(1) == T && out.size(2) == H && V <= D, "out: expected [", B, ", ", T,
              ", ", H, ", V <= ", D, "], found ", out.sizes());
  TORCH_CHECK(q_pos.numel() == 0 || (q_pos.dim() == 1 && q_pos.size(0) == T), "q_pos: expected [", T,
              "] or empty, found ", q_pos.sizes());
  TORCH_CHECK(n >= 1 && D >= 1, "dense_attention: expected at least one position and D >= 1");
  TORCH_CHECK(runs(), "dense_attention: this CPU (or its operating system) offers no AMX-BF16");
#ifdef EM_AMX
  if (B == 0 || T == 0 || H == 0 || V == 0) return;
  const int64_t* pos = q_pos.numel() ? q_pos.data_ptr<int64_t>() : nullptr;
  if (pos)
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0, "q_pos: position ", pos[t], " of query ", t, " < 0");
  Problem pr{reinterpret_cast<const uint16_t*>(q.const_data_ptr()), reinterpret_cast<const uint16_t*>(kv.const_data_ptr()),
             pos, out.data_ptr<float>(), B, T, H, n, D, V, float(scale)};
  run(pr);
#endif
}

}  // namespace

TORCH_LIBRARY(expertmesh_attention_amx, m) {
  m.def("dense_attention(Tensor q, Tensor kv, Tensor q_pos, float scale, Tensor(a!) out) -> ()", &dense_attention);
  m.def("runs() -> bool", &runs);
}
