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
#include <limits>
#include <vector>

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

__attribute__((target_clones("avx512f", "avx2", "default")))
float dot_f32(const float* q, const float* k, int64_t D) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + q[i + l] * k[i + l];
  for (int l = 0; i + l < D; ++l) acc[l] = acc[l] + q[i + l] * k[i + l];
  return lane_tree(acc);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
float dot_bf16(const float* q, const uint16_t* k, int64_t D) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + q[i + l] * bf16_to_float(k[i + l]);
  for (int l = 0; i + l < D; ++l) acc[l] = acc[l] + q[i + l] * bf16_to_float(k[i + l]);
  return lane_tree(acc);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void axpy_f32(float a, const float* v, float* o, int64_t V) {
  for (int64_t d = 0; d < V; ++d) o[d] = o[d] + a * v[d];
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void axpy_bf16(float a, const uint16_t* v, float* o, int64_t V) {
  for (int64_t d = 0; d < V; ++d) o[d] = o[d] + a * bf16_to_float(v[d]);
}

template <typename T>
void attend(const float* q, const T* kv, const int32_t* table, const int64_t* idx, int64_t W, int64_t MB,
            int64_t NB, int64_t BS, int64_t D, int64_t V, float scale, float* out,
            float (*dot)(const float*, const T*, int64_t), void (*axpy)(float, const T*, float*, int64_t)) {
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
  std::vector<float> l(n);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    l[j] = dot(q, rows[j], D) * scale;
    m = l[j] > m ? l[j] : m;
  }
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    l[j] = std::exp(l[j] - m);
    s = s + l[j];
  }
  for (int64_t d = 0; d < V; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) axpy(l[j], rows[j], out, V);
  for (int64_t d = 0; d < V; ++d) out[d] = out[d] / s;
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
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H;
      if (bf16)
        attend<uint16_t>(qs + i * D, static_cast<const uint16_t*>(base), tab + b * MB, id + b * W, W, MB, NB, BS, D,
                         V, fscale, o + i * V, dot_bf16, axpy_bf16);
      else
        attend<float>(qs + i * D, static_cast<const float*>(base), tab + b * MB, id + b * W, W, MB, NB, BS, D, V,
                      fscale, o + i * V, dot_f32, axpy_f32);
    }
  });
}

}  // namespace

TORCH_LIBRARY(expertmesh_dsa_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor indices, float scale, Tensor(a!) out) "
        "-> ()", &paged_attention);
}
