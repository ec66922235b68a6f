// Sparse attention over a paged latent cache for CPUs (DSA / MLA decode): one translation unit, built on first use
// by expertmesh/kernels/dsa/cpu_kernel.py with torch.utils.cpp_extension.load.
//
// For each sequence b and head h, over the logical positions indices[b, :] (-1 = unused, skipped):
//     l_j = dot(q[b, h], kv[row(j)]) * scale          row(j) = block_table[b, j / BS] * BS + j % BS
//     m = max_j l_j;  e_j = exp(l_j - m);  s = sum_j e_j;  out[b, h, :] = (sum_j e_j * kv[row(j), :V]) / s
// Every reduction has one fixed order that depends only on (b, h)'s own inputs: a dot product runs 16 lanes
// (lane l takes elements l, l + 16, ...; the tail in order), folded by the tree 8, 4, 2, 1; the max, the sum of
// e_j and each output element run over j in index order; exp is the scalar libm function. So a sequence's result
// does not depend on the other sequences in the call, how wide the index rows are, or the thread count, and
// -ffp-contract=off keeps a multiply and an add apart on every instruction set the compiler clones for.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_features.h"  // kernels/cpu/: EM_X86, EM_AMX, em_cpu::features(), em_cpu::amx_usable()

namespace {

constexpr int kLanes = 16;

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float lane_tree(float* a) {
  for (int h = kLanes / 2; h >= 1; h >>= 1)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return a[0];
}

// Rows are read once per group of up to kGroup heads (MLA / DSA heads share one latent cache row) and dotted
// with the group's queries side by side: independent accumulator chains, so the loop is not bound by the adder's
// latency, and a bf16 row is widened once per group, not once per head. Widening is exact, and every head keeps
// the lane order above, so the bits are those of a one-head-at-a-time loop. The AVX-512 path spells the order
// out with intrinsics (a multiply, then an add: no FMA); the portable loops compute the same operations.
constexpr int kGroup = 4;

template <typename T>
inline float load_f32(const T* p, int64_t i) {
  if constexpr (std::is_same<T, float>::value) return p[i];
  else return bf16_to_float(p[i]);
}

template <typename T>
__attribute__((target_clones("avx2", "default")))
void dots_portable(const float* const* q, int G, const T* k, int64_t D, float scale, float* out) {
  for (int g = 0; g < G; ++g) {
    float acc[kLanes] = {0.0f};
    int64_t i = 0;
    for (; i + kLanes <= D; i += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + q[g][i + l] * load_f32(k, i + l);
    for (int l = 0; i + l < D; ++l) acc[l] = acc[l] + q[g][i + l] * load_f32(k, i + l);
    out[g] = lane_tree(acc) * scale;
  }
}

// o[g][d] = sum over j in order of e[j * G + g] * rows[j][d], from +0 (then divided by the softmax sum).
template <typename T>
__attribute__((target_clones("avx2", "default")))
void weighted_sum_portable(const float* e, int G, const T* const* rows, int64_t n, float* const* o, int64_t V) {
  for (int g = 0; g < G; ++g) {
    for (int64_t d = 0; d < V; ++d) o[g][d] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float a = e[j * G + g];
      for (int64_t d = 0; d < V; ++d) o[g][d] = o[g][d] + a * load_f32(rows[j], d);
    }
  }
}

#ifdef EM_X86
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const T* p, __mmask16 m) {
  if constexpr (std::is_same<T, float>::value) return _mm512_maskz_loadu_ps(m, p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float tree512(__m512 a) {  // lanes l + 8, + 4, + 2, + 1, as lane_tree
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
  const __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
  return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

template <typename T, int G>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dots_avx512(const float* const* q, const T* k, int64_t D,
                                                                        float scale, float* out) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += kLanes) {
    const __mmask16 m = D - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (D - i)) - 1);
    const __m512 kv = load16(k + i, m);
    for (int g = 0; g < G; ++g)
      acc[g] = _mm512_mask_add_ps(acc[g], m, acc[g], _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q[g] + i), kv));
  }
  for (int g = 0; g < G; ++g) out[g] = tree512(acc[g]) * scale;
}

// 64 output columns at a time held in registers over all rows (G heads x 4 vectors of accumulators).
template <typename T, int G>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void weighted_sum_avx512(const float* e, const T* const* rows,
                                                                                int64_t n, float* const* o, int64_t V) {
  constexpr int C = 4;
  for (int64_t d0 = 0; d0 < V; d0 += C * kLanes) {
    __mmask16 m[C];
    for (int c = 0; c < C; ++c) {
      const int64_t left = V - d0 - c * kLanes;
      m[c] = left >= kLanes ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      __m512 x[C];
      for (int c = 0; c < C; ++c) x[c] = load16(rows[j] + d0 + c * kLanes, m[c]);
      for (int g = 0; g < G; ++g) {
        const __m512 a = _mm512_set1_ps(e[j * G + g]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_add_ps(acc[g][c], _mm512_mul_ps(a, x[c]));
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(o[g] + d0 + c * kLanes, m[c], acc[g][c]);
  }
}

bool has_avx512() {
  const em_cpu::Features& f = em_cpu::features();
  return f.avx512f && f.avx512bw && f.avx512vl;
}
#endif

template <typename T>
void dots(const float* const* q, int G, const T* k, int64_t D, float scale, float* out) {
#ifdef EM_X86
  if (has_avx512()) {
    switch (G) {
      case 4: return dots_avx512<T, 4>(q, k, D, scale, out);
      case 3: return dots_avx512<T, 3>(q, k, D, scale, out);
      case 2: return dots_avx512<T, 2>(q, k, D, scale, out);
      default: return dots_avx512<T, 1>(q, k, D, scale, out);
    }
  }
#endif
  dots_portable(q, G, k, D, scale, out);
}

template <typename T>
void weighted_sum(const float* e, int G, const T* const* rows, int64_t n, float* const* o, int64_t V) {
#ifdef EM_X86
  if (has_avx512()) {
    switch (G) {
      case 4: return weighted_sum_avx512<T, 4>(e, rows, n, o, V);
      case 3: return weighted_sum_avx512<T, 3>(e, rows, n, o, V);
      case 2: return weighted_sum_avx512<T, 2>(e, rows, n, o, V);
      default: return weighted_sum_avx512<T, 1>(e, rows, n, o, V);
    }
  }
#endif
  weighted_sum_portable(e, G, rows, n, o, V);
}

// Heads h0 .. h0+G-1 of one sequence: q rows [G][D] (stride D), out rows [G][V] (stride V).
template <typename T>
void attend(const float* q, int G, const T* kv, const int32_t* table, const int64_t* idx, int64_t W, int64_t MB,
            int64_t NB, int64_t BS, int64_t D, int64_t V, float scale, float* out) {
  std::vector<const T*> rows;
  rows.reserve(W);
  for (int64_t j = 0; j < W; ++j) {
    const int64_t pos = idx[j];
    if (pos < 0) continue;
    TORCH_CHECK(pos < MB * BS, "indices: position ", pos, " is past the block table's ", MB * BS, " entries");
    const int64_t block = table[pos / BS];
    TORCH_CHECK(block >= 0 && block < NB, "block_table: block ", block, " outside [0, ", NB, ")");
    rows.push_back(kv + (block * BS + pos % BS) * D);
  }
  TORCH_CHECK(!rows.empty(), "indices: a row without any used position");
  const int64_t n = int64_t(rows.size());
  const float* qs[kGroup];
  float* os[kGroup];
  for (int g = 0; g < G; ++g) {
    qs[g] = q + g * D;
    os[g] = out + g * V;
  }
  std::vector<float> l(n * G);  // [j][g]
  for (int64_t j = 0; j < n; ++j) dots(qs, G, rows[j], D, scale, l.data() + j * G);
  float s[kGroup];
  for (int g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = l[j * G + g] > m ? l[j * G + g] : m;
    s[g] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      l[j * G + g] = std::exp(l[j * G + g] - m);
      s[g] = s[g] + l[j * G + g];
    }
  }
  weighted_sum(l.data(), G, rows.data(), n, os, V);
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < V; ++d) os[g][d] = os[g][d] / s[g];
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// q [B, H, D] fp32, kv_cache [NB, BS, D] fp32 | bf16, block_table [B, MB] int32, indices [B, W] int64,
// out [B, H, V] fp32 (preallocated), V <= D.
void paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                     const at::Tensor& indices, double scale, const at::Tensor& out) {
  check_cpu(q, "q");
  check_cpu(kv, "kv_cache");
  check_cpu(block_table, "block_table");
  check_cpu(indices, "indices");
  check_cpu(out, "out");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q, out: expected float32");
  TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16,
              "kv_cache: expected float32 or bfloat16, found ", kv.scalar_type());
  TORCH_CHECK(block_table.scalar_type() == at::kInt, "block_table: expected int32");
  TORCH_CHECK(indices.scalar_type() == at::kLong, "indices: expected int64");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && block_table.dim() == 2 && indices.dim() == 2 && out.dim() == 3,
              "paged_attention: expected q [B,H,D], kv_cache [NB,BS,D], block_table [B,MB], indices [B,W], "
              "out [B,H,V]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), NB = kv.size(0), BS = kv.size(1);
  const int64_t MB = block_table.size(1), W = indices.size(1), V = out.size(2);
  TORCH_CHECK(kv.size(2) == D, "kv_cache: last dim ", kv.size(2), ", expected D = ", D);
  TORCH_CHECK(block_table.size(0) == B && indices.size(0) == B && out.size(0) == B && out.size(1) == H,
              "paged_attention: batch / head sizes do not match");
  TORCH_CHECK(V <= D, "out: v_dim ", V, " > D ", D);
  const float fscale = static_cast<float>(scale);
  const float* qs = q.data_ptr<float>();
  const int32_t* tab = block_table.data_ptr<int32_t>();
  const int64_t* id = indices.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const bool bf16 = kv.scalar_type() == at::kBFloat16;
  const void* base = kv.data_ptr();
  const int64_t groups = (H + kGroup - 1) / kGroup;
  at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / groups, h0 = (i % groups) * kGroup;
      const int G = int(std::min<int64_t>(kGroup, H - h0));
      const float* qg = qs + (b * H + h0) * D;
      float* og = o + (b * H + h0) * V;
      if (bf16)
        attend<uint16_t>(qg, G, static_cast<const uint16_t*>(base), tab + b * MB, id + b * W, W, MB, NB, BS, D, V,
                         fscale, og);
      else
        attend<float>(qg, G, static_cast<const float*>(base), tab + b * MB, id + b * W, W, MB, NB, BS, D, V, fscale,
                      og);
    }
  });
}

}  // namespace

TORCH_LIBRARY(expertmesh_dsa_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor indices, float scale, Tensor(a!) out) "
        "-> ()", &paged_attention);
}
