// One token of Kimi Delta Attention's recurrence for CPUs (decode): the dozen ATen ops of the PyTorch recurrent
// form (kernels/kda/fused_recurrent.py) as one op that reads each head's state once and writes it once; and a
// prompt's tokens through the same step in one op (recurrent_steps_, prefill). One translation unit, built on first
// use by expertmesh/kernels/kda/cpu_kernel.py with torch.utils.cpp_extension.load.
//
// Per (sequence, head) row h, with S = state[h] [K, V] fp32, q, k, g [K] and v [V] fp32, beta a scalar:
//   S ← S · exp(g)[:, None];   err = v − kᵀS;   S ← S + (beta · k) ⊗ err;   o = (q · scale)ᵀ S
// the steps of the PyTorch form, each product and sum one fp32 rounding (-ffp-contract=off: no FMA on any of the
// instruction sets the loops are cloned for, so the clones give the same bits). The two sums over K (kᵀS and qᵀS)
// run in row order i = 0 .. K-1 for every column; the PyTorch form's bmm sums in its own order, so the two agree
// to fp32 rounding. Threads split heads, never a head, so a row's result is bitwise the same alone or in any
// batch, at any position, on any thread count.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// S[i, :] ← S[i, :] · d_i, written to out; acc[:] = Σ_i k_i · out[i, :] (row order).
__attribute__((target_clones("avx512f", "avx2", "default")))
void decay_and_project(const float* S, const float* decay, const float* k, int64_t K, int64_t V, float* out,
                       float* acc) {
  for (int64_t j = 0; j < V; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    const float d = decay[i], ki = k[i];
    const float* s = S + i * V;
    float* o = out + i * V;
    for (int64_t j = 0; j < V; ++j) {
      o[j] = s[j] * d;
      acc[j] = acc[j] + ki * o[j];
    }
  }
}

// out[i, :] ← out[i, :] + bk_i · err[:];  o[:] = Σ_i q_i · out[i, :] (row order).
__attribute__((target_clones("avx512f", "avx2", "default")))
void update_and_read(float* out, const float* bk, const float* err, const float* q, int64_t K, int64_t V,
                     float* o) {
  for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    const float b = bk[i], qi = q[i];
    float* s = out + i * V;
    for (int64_t j = 0; j < V; ++j) {
      s[j] = s[j] + b * err[j];
      o[j] = o[j] + qi * s[j];
    }
  }
}

void check_f32(const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK_VALUE(t.defined(), name, ": expected a tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, found ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, found ", c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), name, ": expected ", at::IntArrayRef(shape), ", found ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// One token of row r: qr, kr, gr [K], vr [V], b its beta; S the row's state [K, V], the new one written to `out`
// (which may be S: each element is read before it is written); o [V]. decay, bk, qk [K] and err [V] are scratch.
inline void step_one(const float* qr, const float* kr, const float* vr, const float* gr, float b, const float* S,
                     float fscale, int64_t K, int64_t V, float* out, float* o, float* decay, float* bk, float* qk,
                     float* err) {
  for (int64_t i = 0; i < K; ++i) {
    decay[i] = std::exp(gr[i]);
    bk[i] = b * kr[i];
    qk[i] = qr[i] * fscale;
  }
  decay_and_project(S, decay, kr, K, V, out, err);
  for (int64_t j = 0; j < V; ++j) err[j] = vr[j] - err[j];
  update_and_read(out, bk, err, qk, K, V, o);
}

// q, k, g [R, K]; v [R, V]; beta [R]; state [R, K, V]; all fp32, contiguous. Writes o [R, V] and the new state
// into `out` (which may be `state` itself: each element is read before it is written, by the same thread).
void step_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const at::Tensor& state, double scale, const at::Tensor& o,
               const at::Tensor& out) {
  TORCH_CHECK_VALUE(state.defined() && state.dim() == 3, "state: expected [rows, K, V], found ",
                    state.defined() ? state.sizes() : at::IntArrayRef{});
  const int64_t R = state.size(0), K = state.size(1), V = state.size(2);
  check_f32(state, "state", {R, K, V});
  check_f32(q, "q", {R, K});
  check_f32(k, "k", {R, K});
  check_f32(g, "g", {R, K});
  check_f32(v, "v", {R, V});
  check_f32(beta, "beta", {R});
  const float fscale = static_cast<float>(scale);
  const float *qs = q.data_ptr<float>(), *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  const float *gs = g.data_ptr<float>(), *bs = beta.data_ptr<float>(), *S = state.data_ptr<float>();
  float *os = o.data_ptr<float>(), *outs = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> decay(K), bk(K), qk(K), err(V);
    for (int64_t r = r0; r < r1; ++r)
      step_one(qs + r * K, ks + r * K, vs + r * V, gs + r * K, bs[r], S + r * K * V, fscale, K, V, outs + r * K * V,
               os + r * V, decay.data(), bk.data(), qk.data(), err.data());
  });
}

// T tokens of each row in order, the state updated in place: q, k, g [T, R, K]; v [T, R, V]; beta [T, R];
// state [R, K, V] → o [T, R, V]. Token t of row r is exactly the one-token step on the state after t tokens, so
// the result is the bits of T `recurrent_step_` calls. A thread takes whole rows (heads) and walks all T tokens
// of each, so a row's state stays in that core's cache for the whole prompt (prefill).
at::Tensor recurrent_steps_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& state, double scale) {
  TORCH_CHECK_VALUE(state.defined() && state.dim() == 3, "state: expected [rows, K, V], found ",
                    state.defined() ? state.sizes() : at::IntArrayRef{});
  TORCH_CHECK_VALUE(q.defined() && q.dim() == 3, "q: expected [T, rows, K], found ",
                    q.defined() ? q.sizes() : at::IntArrayRef{});
  const int64_t T = q.size(0), R = state.size(0), K = state.size(1), V = state.size(2);
  check_f32(state, "state", {R, K, V});
  check_f32(q, "q", {T, R, K});
  check_f32(k, "k", {T, R, K});
  check_f32(g, "g", {T, R, K});
  check_f32(v, "v", {T, R, V});
  check_f32(beta, "beta", {T, R});
  at::Tensor o = at::empty({T, R, V}, state.options());
  const float fscale = static_cast<float>(scale);
  const float *qs = q.data_ptr<float>(), *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  const float *gs = g.data_ptr<float>(), *bs = beta.data_ptr<float>();
  float *S = state.data_ptr<float>(), *os = o.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> decay(K), bk(K), qk(K), err(V);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t tr = t * R + r;
        step_one(qs + tr * K, ks + tr * K, vs + tr * V, gs + tr * K, bs[tr], S + r * K * V, fscale, K, V,
                 S + r * K * V, os + tr * V, decay.data(), bk.data(), qk.data(), err.data());
      }
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor> recurrent_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta,
                                                  const at::Tensor& state, double scale) {
  TORCH_CHECK_VALUE(state.defined() && state.dim() == 3, "state: expected [rows, K, V]");
  at::Tensor o = at::empty({state.size(0), state.size(2)}, state.options());
  at::Tensor out = at::empty(state.sizes(), state.options());
  step_rows(q, k, v, g, beta, state, scale, o, out);
  return {o, out};
}

// The same step with the state updated in place (no new state: at decode, fresh pages for it cost more than the
// arithmetic) → o [R, V].
at::Tensor recurrent_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const at::Tensor& state, double scale) {
  TORCH_CHECK_VALUE(state.defined() && state.dim() == 3, "state: expected [rows, K, V]");
  at::Tensor o = at::empty({state.size(0), state.size(2)}, state.options());
  step_rows(q, k, v, g, beta, state, scale, o, state);
  return o;
}

}  // namespace

TORCH_LIBRARY(expertmesh_kda_cpu, m) {
  m.def("recurrent_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, float scale) -> "
        "(Tensor, Tensor)",
        &recurrent_step);
  m.def("recurrent_step_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, float scale) -> "
        "Tensor",
        &recurrent_step_);
  m.def("recurrent_steps_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, float scale) -> "
        "Tensor",
        &recurrent_steps_);
}
