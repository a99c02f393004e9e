// SPDX-License-Identifier: Apache-2.0
// The steps of Expected Attention's scoring of one kv head
// (policy/eviction/expected_attention.hpp) as ops, so a device backend runs
// them on device memory: the query statistics, their rotation by the averaged
// RoPE, the expected logits with their max, the softmax accumulation and the
// final value-norm scaling. Each step has a reference here (the host path's
// arithmetic, which calls it too) and dispatches to the backend's own member
// of the same name when it has one (`backend::Cuda`); every pointer is then
// device memory except the RoPE tables `cb` / `sb`, which the host computes
// from the parameters and passes by value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {

/// Tokens whose fp32 covariance products are summed before the double accumulator.
inline constexpr std::int64_t kExpectedStatBlock = 64;
/// The largest head_dim a device backend takes (its RoPE tables travel as launch arguments).
inline constexpr std::int64_t kExpectedMaxDeviceDim = 256;

/// Mean and (use_cov) population covariance of query head `head`, pre-RoPE,
/// over rows [t0, q.extent(1)) in double: token-order sums per channel; the
/// covariance's upper triangle from fp32 products of the centred rows summed
/// in blocks of 64 tokens (one fused multiply-add per term), the blocks summed in
/// double, then divided by N and mirrored. `block`: d*d floats, `c`: 64*d floats.
template <class B, class Tq>
void expected_statistics_reference(const TensorView<const Tq, 3>& queries, std::int64_t head, std::int64_t t0, std::int64_t d, bool use_cov,
                                   double* mu, double* cov, float* block, float* c) noexcept {
  const std::int64_t t1 = queries.extent(1), N = t1 - t0;
  const bool contiguous = queries.stride(2) == 1;
  const auto widen = [&](std::int64_t t, float* dst) {
    if (contiguous) {
      B::widen_row(&queries(head, t, 0), d, dst);
    } else {
      for (std::int64_t i = 0; i < d; ++i) dst[i] = to_float(queries(head, t, i));
    }
  };
  // Tokens [tb, tb + nt) into c (nt rows of d): one widening call when the rows are contiguous.
  const bool packed = contiguous && queries.stride(1) == d;
  const auto widen_block = [&](std::int64_t tb, std::int64_t nt) {
    if (packed) return B::widen_row(&queries(head, tb, 0), nt * d, c);
    for (std::int64_t t = 0; t < nt; ++t) widen(tb + t, c + t * d);
  };
  std::fill(mu, mu + d, 0.0);
  for (std::int64_t tb = t0; tb < t1; tb += kExpectedStatBlock) {  // sums over the tokens in order, per channel
    const std::int64_t nt = std::min(t1, tb + kExpectedStatBlock) - tb;
    widen_block(tb, nt);
    B::accumulate_rows_f64(c, nt, d, mu);
  }
  for (std::int64_t i = 0; i < d; ++i) mu[i] /= static_cast<double>(N);
  if (!use_cov) return;
  std::fill(cov, cov + d * d, 0.0);
  for (std::int64_t tb = t0; tb < t1; tb += kExpectedStatBlock) {
    const std::int64_t nt = std::min(t1, tb + kExpectedStatBlock) - tb;
    widen_block(tb, nt);
    B::centre_rows(c, nt, d, mu);
    if constexpr (requires { B::outer_upper_add_f64(c, nt, d, cov); }) {
      B::outer_upper_add_f64(c, nt, d, cov);  // the two steps below in one (backend::Cpu), the same bits
    } else {
      std::fill(block, block + d * d, 0.0f);
      B::outer_upper_accumulate(c, nt, d, block);
      B::add_upper_f64(block, d, cov);
    }
  }
  for (std::int64_t i = 0; i < d; ++i)
    for (std::int64_t j = i; j < d; ++j) cov[j * d + i] = cov[i * d + j] = cov[i * d + j] / static_cast<double>(N);
}

/// The statistics rotated by the averaged RoPE R (R[i][i] = cb[i], R[i][i+h] =
/// -sb[i+h], R[i+h][i] = sb[i], h = d/2), in double: mf = fp32(R mu); when
/// cov is non-null, cov <- R cov (row pairs in place) and covf = fp32((R cov) R^T).
inline void expected_rotate_reference(const double* mu, double* cov, std::int64_t d, const float* cb, const float* sb, float* mf,
                                      float* covf) noexcept {
  const std::int64_t h = d / 2;
  const auto partner = [h](std::int64_t i) { return i < h ? i + h : i - h; };
  const auto off = [&](std::int64_t i) { return i < h ? -static_cast<double>(sb[i + h]) : static_cast<double>(sb[i - h]); };
  for (std::int64_t i = 0; i < d; ++i) mf[i] = static_cast<float>(static_cast<double>(cb[i]) * mu[i] + off(i) * mu[partner(i)]);
  if (cov == nullptr) return;
  for (std::int64_t i = 0; i < h; ++i) {
    for (std::int64_t j = 0; j < d; ++j) {
      const double a = cov[i * d + j], b = cov[(i + h) * d + j];
      cov[i * d + j] = static_cast<double>(cb[i]) * a + off(i) * b;
      cov[(i + h) * d + j] = static_cast<double>(cb[i + h]) * b + off(i + h) * a;
    }
  }
  for (std::int64_t i = 0; i < d; ++i)
    for (std::int64_t j = 0; j < d; ++j)
      covf[i * d + j] = static_cast<float>(cov[i * d + j] * static_cast<double>(cb[j]) + cov[i * d + partner(j)] * off(j));
}

/// The head's final scores: s[j] = s[j] / G, then (s[j] + eps) * |v_j| when
/// `neg_norm` (= -|v_j|) is given, for j in [n0, T); the n0 sinks +inf.
inline void expected_finish_reference(float* s, const float* neg_norm, std::int64_t n0, std::int64_t T, std::int64_t G,
                                      float eps) noexcept {
  for (std::int64_t j = n0; j < T; ++j) {
    float v = s[j] / static_cast<float>(G);
    if (neg_norm != nullptr) v = (v + eps) * -neg_norm[j];
    s[j] = v;
  }
  for (std::int64_t j = 0; j < std::min(n0, T); ++j) s[j] = INFINITY;
}

template <class B, class Tq>
void expected_statistics(const TensorView<const Tq, 3>& q, std::int64_t head, std::int64_t t0, std::int64_t d, bool use_cov, double* mu,
                         double* cov, float* block, float* c) noexcept {
  if constexpr (requires { B::expected_statistics(q, head, t0, d, use_cov, mu, cov, block, c); })
    B::expected_statistics(q, head, t0, d, use_cov, mu, cov, block, c);
  else
    expected_statistics_reference<B>(q, head, t0, d, use_cov, mu, cov, block, c);
}

template <class B>
void expected_rotate(const double* mu, double* cov, std::int64_t d, const float* cb, const float* sb, float* mf, float* covf) noexcept {
  if constexpr (requires { B::expected_rotate(mu, cov, d, cb, sb, mf, covf); })
    B::expected_rotate(mu, cov, d, cb, sb, mf, covf);
  else
    expected_rotate_reference(mu, cov, d, cb, sb, mf, covf);
}

/// `expected_logits` with its max stored at *mx (device memory on a device backend) instead of returned.
template <class B, class Tk>
void expected_logits_max(const float* mean, const float* cov, std::int64_t d, const Rows<Tk>& keys, std::int64_t j0, std::int64_t j1,
                         float* z, float* scratch, float* mx) noexcept {
  if constexpr (requires { B::expected_logits_max(mean, cov, d, keys, j0, j1, z, scratch, mx); })
    B::expected_logits_max(mean, cov, d, keys, j0, j1, z, scratch, mx);
  else
    *mx = B::expected_logits(mean, cov, d, keys, j0, j1, z, scratch);
}

/// Workspace of `expected_softmax` for T keys (a device backend's partial sums; 0 on the host).
template <class B>
std::size_t expected_softmax_workspace(std::int64_t T) noexcept {
  if constexpr (requires { B::expected_softmax_workspace(T); })
    return B::expected_softmax_workspace(T);
  else
    return 0;
}

/// `softmax_accumulate` with the max read from *mx.
template <class B>
void expected_softmax(float* z, std::int64_t j0, std::int64_t j1, const float* mx, float* s, Workspace ws) noexcept {
  if constexpr (requires { B::expected_softmax(z, j0, j1, mx, s, ws); })
    B::expected_softmax(z, j0, j1, mx, s, ws);
  else
    B::softmax_accumulate(z, j0, j1, *mx, s);
}

template <class B>
void expected_finish(float* s, const float* neg_norm, std::int64_t n0, std::int64_t T, std::int64_t G, float eps) noexcept {
  if constexpr (requires { B::expected_finish(s, neg_norm, n0, T, G, eps); })
    B::expected_finish(s, neg_norm, n0, T, G, eps);
  else
    expected_finish_reference(s, neg_norm, n0, T, G, eps);
}

}  // namespace ops
KVP_NAMESPACE_END
