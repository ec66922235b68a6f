// Row norms and rotary embeddings for CPUs: RMSNorm, LayerNorm, the L2 normalisation of KDA's q / k, and RoPE, one
// op each in place of the dozen ATen ops of their PyTorch forms (kernels/norm/naive.py). One translation unit,
// built on first use by expertmesh/kernels/norm/cpu_kernel.py with torch.utils.cpp_extension.load.
//
// Input x: fp32 or bf16, any leading shape, last dim D with unit stride (the leading dims may be strided views,
// e.g. MLA's q[:, :, nope:]); a row is one index of the leading dims. Output: a new contiguous tensor of x's shape,
// in x's dtype (l2_normalize: fp32, as its PyTorch form). All math in fp32 (bf16 inputs and weights are widened
// exactly; the result is rounded to bf16 once, to nearest even).
//
//   rms_norm:      ss = Σ x²;  r = 1 / sqrt(ss / D + eps);  y = (x · r) · w
//   layer_norm:    m = Σ x / D;  c = x − m;  v = Σ c² / D;  r = 1 / sqrt(v + eps);  y = (c · r) · w + b
//   l2_normalize:  ss = Σ x²;  r = 1 / sqrt(ss + eps);  y = x · r
//   rotary:        pairs (x1, x2) = (x[j], x[j + D/2]) ("half") or (x[2j], x[2j + 1]) ("interleaved"), with
//                  c = cos[t, j], s = sin[t, j] of the row's token t:  y[j] = x1·c − x2·s,  y[j + D/2] = x2·c + x1·s
//   residual_mix:  Kimi K3's attention-residual mix of one row over its J sources S_j (the banked blocks, then the
//                  current stream): w = norm · proj;  score_j = (Σ S_j·w) · 1 / sqrt(Σ S_j² / D + eps);
//                  p = softmax_j(score) (max, exp, Σ and division in source order);  y = Σ_j p_j · S_j in source
//                  order, y in the last source's dtype
//
// Numerics. Every multiply, add, subtract, divide and sqrt is one IEEE fp32 operation, rounded; -ffp-contract=off
// keeps a multiply and an add apart (no FMA) on every instruction set the hot loops are cloned for (AVX-512, AVX2,
// baseline), so the clones give the same bits. The elementwise expressions have the structure of the PyTorch
// forms (the same operations on the same operands, and 1 / sqrt is what ATen's rsqrt computes), so rotary is
// bitwise the PyTorch result; the norms differ from it only in the order of each row's sum: here a sum runs in 16
// lanes (lane l takes elements l, l + 16, l + 32, ...; the tail, in order, goes to lanes 0, 1, ...), folded by
// the fixed tree 8, 4, 2, 1 — an order that depends only on D. Threads split rows, never a row, so a row's result
// is bitwise the same alone or in any batch, at any position, on any thread count.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kGrainElements = 16384;   // elements per parallel work item (at least one row)

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 (a NaN stays a NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(rounded);
}

template <typename T>
inline float ld(const T* p, int64_t i) {
  if constexpr (std::is_same<T, float>::value) return p[i];
  else return bf16_to_float(p[i]);
}

template <typename T>
inline void st(T* p, int64_t i, float v) {
  if constexpr (std::is_same<T, float>::value) p[i] = v;
  else p[i] = float_to_bf16(v);
}

inline float lane_tree(float* a) {
  for (int h = kLanes / 2; h >= 1; h >>= 1)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return a[0];
}

// Σ (x[i] − shift)² (square = true) or Σ x[i] (square = false, shift unused), in the lane order above.
template <typename T, bool square>
__attribute__((target_clones("avx512f", "avx2", "default")))
float row_sum(const T* x, int64_t D, float shift) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      if constexpr (square) {
        const float c = ld(x, i + l) - shift;
        acc[l] = acc[l] + c * c;
      } else {
        acc[l] = acc[l] + ld(x, i + l);
      }
    }
  for (int l = 0; i + l < D; ++l) {
    if constexpr (square) {
      const float c = ld(x, i + l) - shift;
      acc[l] = acc[l] + c * c;
    } else {
      acc[l] = acc[l] + ld(x, i + l);
    }
  }
  return lane_tree(acc);
}

// y = ((x − shift) · r) · w (+ b): rms_norm with shift 0 and no bias, layer_norm with the mean and bias, l2 with
// neither weight nor bias. x − 0 is x exactly, so the shift is a no-op for rms / l2.
template <typename T, typename TW, typename TO, bool centre, bool has_w, bool has_b>
__attribute__((target_clones("avx512f", "avx2", "default")))
void row_scale(const T* x, int64_t D, float shift, float r, const TW* w, const TW* b, TO* y) {
  for (int64_t i = 0; i < D; ++i) {
    float v = centre ? ld(x, i) - shift : ld(x, i);
    v = v * r;
    if constexpr (has_w) v = v * ld(w, i);
    if constexpr (has_b) v = v + ld(b, i);
    st(y, i, v);
  }
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void rotate_half(const T* x, int64_t h, const float* c, const float* s, T* y) {
  for (int64_t j = 0; j < h; ++j) {
    const float x1 = ld(x, j), x2 = ld(x, j + h);
    st(y, j, x1 * c[j] - x2 * s[j]);
    st(y, j + h, x2 * c[j] + x1 * s[j]);
  }
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void rotate_interleaved(const T* x, int64_t h, const float* c, const float* s, T* y) {
  for (int64_t j = 0; j < h; ++j) {
    const float x1 = ld(x, 2 * j), x2 = ld(x, 2 * j + 1);
    st(y, j, x1 * c[j] - x2 * s[j]);
    st(y, j + h, x2 * c[j] + x1 * s[j]);
  }
}

// The rows of x (every index of its leading dims, in C order) as element offsets: the leading dims with size-1
// dims dropped and adjacent dims merged where their strides allow (one dim for a contiguous tensor).
struct Rows {
  int64_t count = 1;
  std::vector<int64_t> size, stride;   // outermost first

  explicit Rows(const at::Tensor& x) {
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      const int64_t n = x.size(d), st = x.stride(d);
      count *= n;
      if (n == 1) continue;
      if (!size.empty() && stride.back() == st * n) {
        size.back() *= n;
        stride.back() = st;
      } else {
        size.push_back(n);
        stride.push_back(st);
      }
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = int64_t(size.size()) - 1; d >= 0; --d) {
      off += (r % size[d]) * stride[d];
      r /= size[d];
    }
    return off;
  }
};

const char* dtype_name(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

// x: a CPU fp32 / bf16 tensor of rank >= min_dim; returned with a unit-stride last dim (copied only if needed).
at::Tensor check_x(const at::Tensor& x, const char* name, int64_t min_dim) {
  TORCH_CHECK_VALUE(x.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(x.device().is_cpu(), name, ": expected a CPU tensor, found ", x.device());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
                   ": expected float32 or bfloat16, found ", dtype_name(x));
  TORCH_CHECK_VALUE(x.dim() >= min_dim, name, ": expected at least ", min_dim, " dims, found ", x.sizes());
  return x.size(-1) <= 1 || x.stride(-1) == 1 ? x : x.contiguous();
}

// A per-element parameter [D] (weight, bias): CPU, floating, D elements; fp32 / bf16 as is, others widened to fp32.
at::Tensor check_param(const at::Tensor& p, const char* name, int64_t D) {
  TORCH_CHECK_VALUE(p.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(p.device().is_cpu(), name, ": expected a CPU tensor, found ", p.device());
  TORCH_CHECK_TYPE(at::isFloatingType(p.scalar_type()), name, ": expected a floating tensor, found ", dtype_name(p));
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == D, name, ": expected [", D, "] (x's last dim), found ", p.sizes());
  at::Tensor q = p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16 ? p : p.to(at::kFloat);
  return q.contiguous();
}

int64_t grain_rows(int64_t D) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(D, 1)); }

enum class Kind { rms, layer, l2 };

template <Kind kind, typename T, typename TW, typename TO>
void norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& out) {
  const int64_t D = x.size(-1);
  const Rows rows(x);
  const T* xs = static_cast<const T*>(x.data_ptr());
  const TW* ws = w.defined() ? static_cast<const TW*>(w.data_ptr()) : nullptr;
  const TW* bs = b.defined() ? static_cast<const TW*>(b.data_ptr()) : nullptr;
  TO* ys = static_cast<TO*>(out.data_ptr());
  const float feps = static_cast<float>(eps), fD = static_cast<float>(D);
  at::parallel_for(0, rows.count, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xs + rows.offset(r);
      TO* yr = ys + r * D;
      if constexpr (kind == Kind::rms) {
        const float ms = row_sum<T, true>(xr, D, 0.0f) / fD;
        const float rr = 1.0f / std::sqrt(ms + feps);
        row_scale<T, TW, TO, false, true, false>(xr, D, 0.0f, rr, ws, nullptr, yr);
      } else if constexpr (kind == Kind::layer) {
        const float m = row_sum<T, false>(xr, D, 0.0f) / fD;
        const float var = row_sum<T, true>(xr, D, m) / fD;
        const float rr = 1.0f / std::sqrt(var + feps);
        row_scale<T, TW, TO, true, true, true>(xr, D, m, rr, ws, bs, yr);
      } else {
        const float ss = row_sum<T, true>(xr, D, 0.0f);
        const float rr = 1.0f / std::sqrt(ss + feps);
        row_scale<T, float, TO, false, false, false>(xr, D, 0.0f, rr, nullptr, nullptr, yr);
      }
    }
  });
}

template <Kind kind, typename T>
void norm_dispatch_w(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& out) {
  using TO = typename std::conditional<kind == Kind::l2, float, T>::type;
  if (w.defined() && w.scalar_type() == at::kBFloat16) norm_rows<kind, T, uint16_t, TO>(x, w, b, eps, out);
  else norm_rows<kind, T, float, TO>(x, w, b, eps, out);
}

template <Kind kind>
void norm_dispatch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& out) {
  if (x.numel() == 0) return;
  if (x.scalar_type() == at::kBFloat16) norm_dispatch_w<kind, uint16_t>(x, w, b, eps, out);
  else norm_dispatch_w<kind, float>(x, w, b, eps, out);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = check_x(x_in, "x", 1);
  at::Tensor w = check_param(weight, "weight", x.size(-1));
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  norm_dispatch<Kind::rms>(x, w, at::Tensor(), eps, out);
  return out;
}

at::Tensor layer_norm(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const at::Tensor x = check_x(x_in, "x", 1);
  at::Tensor w = check_param(weight, "weight", x.size(-1));
  at::Tensor b = check_param(bias, "bias", x.size(-1));
  if (b.scalar_type() != w.scalar_type()) {   // one parameter dtype per call: both fp32 then (exact widening)
    w = w.to(at::kFloat);
    b = b.to(at::kFloat);
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  norm_dispatch<Kind::layer>(x, w, b, eps, out);
  return out;
}

at::Tensor l2_normalize(const at::Tensor& x_in, double eps) {
  const at::Tensor x = check_x(x_in, "x", 1);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  norm_dispatch<Kind::l2>(x, at::Tensor(), at::Tensor(), eps, out);
  return out;
}

template <typename T>
void rotary_rows(const at::Tensor& x, const float* cs, const float* sn, bool interleaved, at::Tensor& out) {
  const int64_t D = x.size(-1), h = D / 2, T_ = x.size(0);
  const Rows rows(x);
  const int64_t per_token = rows.count / T_;
  const T* xs = static_cast<const T*>(x.data_ptr());
  T* ys = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows.count, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / per_token;
      if (interleaved) rotate_interleaved<T>(xs + rows.offset(r), h, cs + t * h, sn + t * h, ys + r * D);
      else rotate_half<T>(xs + rows.offset(r), h, cs + t * h, sn + t * h, ys + r * D);
    }
  });
}

at::Tensor check_table(const at::Tensor& t, const char* name, int64_t T_, int64_t h) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, found ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, found ", dtype_name(t));
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == T_ && t.size(1) == h, name, ": expected [", T_, ", ", h,
                    "] (x's first dim, half its last), found ", t.sizes());
  return t.contiguous();
}

at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const at::Tensor x = check_x(x_in, "x", 2);
  const int64_t D = x.size(-1), T_ = x.size(0);
  TORCH_CHECK_VALUE(D % 2 == 0, "x: expected an even last dim, found ", x.sizes());
  const at::Tensor c = check_table(cos, "cos", T_, D / 2), s = check_table(sin, "sin", T_, D / 2);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const float* cs = c.data_ptr<float>();
  const float* sn = s.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) rotary_rows<uint16_t>(x, cs, sn, interleaved, out);
  else rotary_rows<float>(x, cs, sn, interleaved, out);
  return out;
}

// Σ x[i]·w[i] in the lane order of row_sum (the products rounded, then summed: no FMA).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
float row_dot(const T* x, const float* w, int64_t D) {
  float acc[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + ld(x, i + l) * w[i + l];
  for (int l = 0; i + l < D; ++l) acc[l] = acc[l] + ld(x, i + l) * w[i + l];
  return lane_tree(acc);
}

// y[i] (+)= p · x[i] in fp32 (first: y = p · x).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void row_axpy(const T* x, int64_t D, float p, float* y, bool first) {
  if (first)
    for (int64_t i = 0; i < D; ++i) y[i] = p * ld(x, i);
  else
    for (int64_t i = 0; i < D; ++i) y[i] = y[i] + p * ld(x, i);
}

template <typename T, typename TO>
void residual_mix_rows(const std::vector<at::Tensor>& src, const float* w, double eps, at::Tensor& out) {
  const int64_t J = int64_t(src.size()), N = src[0].size(0), D = src[0].size(1);
  std::vector<const T*> s(J);
  std::vector<int64_t> ld_(J);
  for (int64_t j = 0; j < J; ++j) {
    s[j] = static_cast<const T*>(src[j].data_ptr());
    ld_[j] = src[j].stride(0);
  }
  TO* ys = static_cast<TO*>(out.data_ptr());
  const float feps = static_cast<float>(eps), fD = static_cast<float>(D);
  at::parallel_for(0, N, grain_rows(D * J), [&](int64_t r0, int64_t r1) {
    std::vector<float> score(J), acc(D);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < J; ++j) {
        const T* x = s[j] + r * ld_[j];
        const float ms = row_sum<T, true>(x, D, 0.0f) / fD;
        score[j] = row_dot<T>(x, w, D) * (1.0f / std::sqrt(ms + feps));
      }
      float top = score[0];
      for (int64_t j = 1; j < J; ++j) top = std::max(top, score[j]);
      float total = 0.0f;
      for (int64_t j = 0; j < J; ++j) {
        score[j] = std::exp(score[j] - top);
        total = j == 0 ? score[j] : total + score[j];
      }
      for (int64_t j = 0; j < J; ++j) row_axpy<T>(s[j] + r * ld_[j], D, score[j] / total, acc.data(), j == 0);
      TO* y = ys + r * D;
      for (int64_t i = 0; i < D; ++i) st(y, i, acc[i]);
    }
  });
}

// sources: J >= 1 tensors [N, D] of one dtype (fp32 / bf16), unit stride along D; norm_weight, proj_weight [D].
at::Tensor residual_mix(const std::vector<at::Tensor>& sources_in, const at::Tensor& norm_weight,
                        const at::Tensor& proj_weight, double eps) {
  TORCH_CHECK_VALUE(!sources_in.empty(), "sources: expected at least one tensor");
  std::vector<at::Tensor> src;
  for (const auto& t : sources_in) src.push_back(check_x(t, "sources", 2));
  const at::Tensor& last = src.back();
  TORCH_CHECK_VALUE(last.dim() == 2, "sources: expected [N, D] tensors, found ", last.sizes());
  for (const auto& t : src) {
    TORCH_CHECK_VALUE(t.sizes() == last.sizes(), "sources: expected every source of shape ", last.sizes(),
                      ", found ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == last.scalar_type(), "sources: expected one dtype (", dtype_name(last),
                     "), found ", dtype_name(t));
  }
  const int64_t D = last.size(1);
  // w = norm · proj in fp32, each product one rounding (the PyTorch form's `norm.float() * proj.float()`)
  const at::Tensor nw = check_param(norm_weight, "norm_weight", D).to(at::kFloat);
  const at::Tensor pw = check_param(proj_weight, "proj_weight", D).to(at::kFloat);
  std::vector<float> w(D);
  for (int64_t i = 0; i < D; ++i) w[i] = nw.data_ptr<float>()[i] * pw.data_ptr<float>()[i];
  at::Tensor out = at::empty(last.sizes(), last.options().memory_format(at::MemoryFormat::Contiguous));
  if (last.numel() == 0) return out;
  if (last.scalar_type() == at::kBFloat16) residual_mix_rows<uint16_t, uint16_t>(src, w.data(), eps, out);
  else residual_mix_rows<float, float>(src, w.data(), eps, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(expertmesh_norm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor", &layer_norm);
  m.def("l2_normalize(Tensor x, float eps) -> Tensor", &l2_normalize);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor", &rotary);
  m.def("residual_mix(Tensor[] sources, Tensor norm_weight, Tensor proj_weight, float eps) -> Tensor", &residual_mix);
}
