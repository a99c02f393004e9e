// SPDX-License-Identifier: Apache-2.0
// Judging a decision against the full cache, per LayerCase.
//
// A `Decision` names, for every row, the prompt tokens an attention step may
// read: one row per kv head (eviction), per query head (Ada-KV's original
// per-query-head cache), or per (decode step, query head) (selection: Quest,
// the oracle). Evaluation query f of query head h reads its row's prompt
// tokens plus the evaluation keys 0..f when the case has them (decode tokens
// are never evicted). Metrics, each averaged over (query head, evaluation query):
//   rel_err       ||o_kept - o_full||_2 / ||o_full||_2 of the attention output
//   mass_recall   full-softmax attention mass on what the row reads
//   topk_overlap  |S ∩ top_|S|| / |S|: S the row's prompt tokens, top_n the n
//                 prompt tokens of highest full-attention weight for that query
//   needle_hit    the needle the query looks for is in S (or, without a
//                 query->needle map, the fraction of needles in S)
//   kept_tokens   |S|
// and per layer: kv_bytes, the K+V bytes the decision keeps (eviction) or reads
// per step (selection; distinct (kv head, token) pairs, at the source's
// element size, plus any page metadata).
// Computation is in double. The full-cache output is computed by the same
// routine over every token, so a decision that keeps everything reproduces it
// bit for bit (rel_err 0, recall 1). Ties in the oracle ranking follow the
// library's order (higher weight, then the higher token index).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <memory>
#include <vector>

#include "kvpolicy/core/parallel.hpp"
#include "layer_case.hpp"

namespace kvp_compare {

struct Decision {
  enum class Rows : std::uint8_t { kKvHead, kQueryHead, kQueryHeadPerStep };
  Rows rows = Rows::kKvHead;
  std::vector<std::int32_t> indptr, indices;  ///< CSR rows of ascending prompt token ids
  double metadata_bytes = 0;                  ///< extra bytes read per step (Quest page metadata), whole layer
  /// Quantization: the case with its prompt K/V stored in the format and decoded back (null: the case itself),
  /// and the format's bytes per value over the source's (kv_bytes is scaled by it).
  std::shared_ptr<const LayerCase> quantized;
  double bytes_scale = 1.0;

  std::int64_t num_rows(const LayerCase& c) const noexcept {
    switch (rows) {
      case Rows::kKvHead: return c.num_kv_heads;
      case Rows::kQueryHead: return c.num_q_heads;
      case Rows::kQueryHeadPerStep: return c.num_q_heads * c.num_eval;
    }
    return 0;
  }
  std::int64_t row_of(const LayerCase& c, std::int32_t qh, std::int64_t f) const noexcept {
    switch (rows) {
      case Rows::kKvHead: return qh / c.group();
      case Rows::kQueryHead: return qh;
      case Rows::kQueryHeadPerStep: return f * c.num_q_heads + qh;
    }
    return 0;
  }
  /// Structural check: row count, ids ascending and inside [0, T).
  bool well_formed(const LayerCase& c) const noexcept {
    const std::int64_t R = num_rows(c);
    if (static_cast<std::int64_t>(indptr.size()) != R + 1 || indptr[0] != 0) return false;
    for (std::int64_t r = 0; r < R; ++r) {
      if (indptr[r + 1] < indptr[r] || indptr[r + 1] > static_cast<std::int64_t>(indices.size())) return false;
      for (std::int32_t i = indptr[r]; i < indptr[r + 1]; ++i) {
        if (indices[i] < 0 || indices[i] >= c.kv_len) return false;
        if (i > indptr[r] && indices[i] <= indices[i - 1]) return false;
      }
    }
    return true;
  }
};

/// Full-cache quantities of the evaluation queries of one case.
struct Reference {
  std::vector<double> logit;       ///< (Hq, F, T) scaled logits of the prompt tokens
  std::vector<double> row_max;     ///< (Hq, F) max logit over prompt and evaluation keys
  std::vector<double> eval_num;    ///< (Hq, F, d) sum_{s<=f} exp(l'_s - max) v'_s
  std::vector<double> eval_den;    ///< (Hq, F)
  std::vector<double> full_out;    ///< (Hq, F, d)
  std::vector<double> full_den;    ///< (Hq, F)
  std::vector<std::int32_t> rank;  ///< (Hq, F, T) rank of each prompt token by weight (0 = heaviest)
};

struct Metrics {
  double rel_err = 0, mass_recall = 0, topk_overlap = 0, needle_hit = std::numeric_limits<double>::quiet_NaN();
  double kept_tokens = 0, kv_bytes = 0;
};

namespace detail {

inline double dot(const float* a, const float* b, std::int32_t d) noexcept {
  double s = 0;
  for (std::int32_t c = 0; c < d; ++c) s += static_cast<double>(a[c]) * static_cast<double>(b[c]);
  return s;
}

/// Unnormalised attention of row (qh, f) over prompt tokens ids[0..n) plus the
/// evaluation keys: out = numerator (d), returns the denominator.
inline double attend(const LayerCase& c, const Reference& r, std::int32_t qh, std::int64_t f, const std::int32_t* ids, std::int64_t n,
                     double* out) noexcept {
  const std::int32_t d = c.head_dim, h = qh / c.group();
  const std::int64_t T = c.kv_len, row = static_cast<std::int64_t>(qh) * c.num_eval + f;
  const double* l = &r.logit[static_cast<std::size_t>(row * T)];
  const double m = r.row_max[static_cast<std::size_t>(row)];
  for (std::int32_t k = 0; k < d; ++k) out[k] = 0.0;
  double den = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t j = ids[i];
    const double p = std::exp(l[j] - m);
    den += p;
    const float* v = &c.v[(static_cast<std::size_t>(h) * T + j) * d];
    for (std::int32_t k = 0; k < d; ++k) out[k] += p * v[k];
  }
  const double* en = &r.eval_num[static_cast<std::size_t>(row * d)];
  for (std::int32_t k = 0; k < d; ++k) out[k] += en[k];
  return den + r.eval_den[static_cast<std::size_t>(row)];
}

}  // namespace detail

/// Full-cache reference of a case (parallel over query heads).
inline Reference make_reference(const LayerCase& c, const kvpolicy::ExecContext& ctx) {
  const std::int32_t Hq = c.num_q_heads, d = c.head_dim, G = c.group();
  const std::int64_t T = c.kv_len, F = c.num_eval;
  Reference r;
  r.logit.resize(static_cast<std::size_t>(Hq * F * T));
  r.row_max.resize(static_cast<std::size_t>(Hq * F));
  r.eval_num.assign(static_cast<std::size_t>(Hq * F * d), 0.0);
  r.eval_den.assign(static_cast<std::size_t>(Hq * F), 0.0);
  r.full_out.resize(static_cast<std::size_t>(Hq * F * d));
  r.full_den.resize(static_cast<std::size_t>(Hq * F));
  r.rank.resize(r.logit.size());
  std::vector<std::int32_t> all(static_cast<std::size_t>(T));
  std::iota(all.begin(), all.end(), 0);
  ctx.parallel_for(Hq, [&](std::int64_t qh, int) {
    const std::int32_t h = static_cast<std::int32_t>(qh) / G;
    std::vector<double> le(static_cast<std::size_t>(F));
    std::vector<std::int32_t> order(static_cast<std::size_t>(T));
    for (std::int64_t f = 0; f < F; ++f) {
      const std::int64_t row = qh * F + f;
      const float* q = &c.eq[static_cast<std::size_t>(row * d)];
      double* l = &r.logit[static_cast<std::size_t>(row * T)];
      double m = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < T; ++j) {
        l[j] = detail::dot(q, &c.k[(static_cast<std::size_t>(h) * T + j) * d], d) * c.scale;
        m = std::max(m, l[j]);
      }
      if (c.has_eval_kv()) {
        for (std::int64_t s = 0; s <= f; ++s) {
          le[static_cast<std::size_t>(s)] = detail::dot(q, &c.ek[(static_cast<std::size_t>(h) * F + s) * d], d) * c.scale;
          m = std::max(m, le[static_cast<std::size_t>(s)]);
        }
        double* en = &r.eval_num[static_cast<std::size_t>(row * d)];
        double den = 0;
        for (std::int64_t s = 0; s <= f; ++s) {
          const double p = std::exp(le[static_cast<std::size_t>(s)] - m);
          den += p;
          const float* v = &c.ev[(static_cast<std::size_t>(h) * F + s) * d];
          for (std::int32_t k = 0; k < d; ++k) en[k] += p * v[k];
        }
        r.eval_den[static_cast<std::size_t>(row)] = den;
      }
      r.row_max[static_cast<std::size_t>(row)] = m;
      r.full_den[static_cast<std::size_t>(row)] =
          detail::attend(c, r, static_cast<std::int32_t>(qh), f, all.data(), T, &r.full_out[static_cast<std::size_t>(row * d)]);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return l[a] != l[b] ? l[a] > l[b] : a > b; });
      std::int32_t* rk = &r.rank[static_cast<std::size_t>(row * T)];
      for (std::int64_t i = 0; i < T; ++i) rk[order[static_cast<std::size_t>(i)]] = static_cast<std::int32_t>(i);
    }
  });
  return r;
}

/// The oracle selection: for every (step, query head), the n prompt tokens of
/// highest full-attention weight.
inline Decision oracle_decision(const LayerCase& c, const Reference& r, std::int64_t n) {
  Decision dec;
  dec.rows = Decision::Rows::kQueryHeadPerStep;
  const std::int64_t T = c.kv_len, F = c.num_eval, Hq = c.num_q_heads;
  n = std::min(n, T);
  dec.indptr.resize(static_cast<std::size_t>(Hq * F + 1));
  dec.indices.reserve(static_cast<std::size_t>(Hq * F * n));
  dec.indptr[0] = 0;
  for (std::int64_t f = 0; f < F; ++f)
    for (std::int64_t qh = 0; qh < Hq; ++qh) {
      const std::int32_t* rk = &r.rank[static_cast<std::size_t>((qh * F + f) * T)];
      for (std::int64_t j = 0; j < T; ++j)
        if (rk[j] < n) dec.indices.push_back(static_cast<std::int32_t>(j));
      dec.indptr[static_cast<std::size_t>(f * Hq + qh + 1)] = static_cast<std::int32_t>(dec.indices.size());
    }
  return dec;
}

/// Metrics of a decision (parallel over query heads; deterministic). `truth` (quantization): `c` / `r` are the
/// quantized case and its reference, and the attention output is compared with the full-precision one in
/// `truth`; mass recall, top-k overlap and needle hits then count the kept tokens against `truth`'s ranking.
inline Metrics evaluate(const LayerCase& c, const Reference& r, const Decision& dec, const kvpolicy::ExecContext& ctx,
                        const Reference* truth = nullptr) {
  const std::int32_t Hq = c.num_q_heads, d = c.head_dim, G = c.group();
  const std::int64_t T = c.kv_len, F = c.num_eval;
  struct Part {
    double rel = 0, mass = 0, overlap = 0, kept = 0, hits = 0, needle_n = 0;
  };
  std::vector<Part> parts(static_cast<std::size_t>(Hq));
  ctx.parallel_for(Hq, [&](std::int64_t qh, int) {
    std::vector<double> o(static_cast<std::size_t>(d));
    Part& p = parts[static_cast<std::size_t>(qh)];
    for (std::int64_t f = 0; f < F; ++f) {
      const std::int64_t row = qh * F + f, dr = dec.row_of(c, static_cast<std::int32_t>(qh), f);
      const std::int32_t* ids = dec.indices.data() + dec.indptr[static_cast<std::size_t>(dr)];
      const std::int64_t n = dec.indptr[static_cast<std::size_t>(dr + 1)] - dec.indptr[static_cast<std::size_t>(dr)];
      const double den = detail::attend(c, r, static_cast<std::int32_t>(qh), f, ids, n, o.data());
      const Reference& tr = truth != nullptr ? *truth : r;
      const double* full = &tr.full_out[static_cast<std::size_t>(row * d)];
      const double fden = tr.full_den[static_cast<std::size_t>(row)];
      double num = 0, nrm = 0;
      for (std::int32_t k = 0; k < d; ++k) {
        const double a = den > 0 ? o[static_cast<std::size_t>(k)] / den : 0.0, b = full[k] / fden;
        num += (a - b) * (a - b);
        nrm += b * b;
      }
      p.rel += nrm > 0 ? std::sqrt(num / nrm) : (num > 0 ? 1.0 : 0.0);
      p.mass += truth != nullptr ? 1.0 : den / fden;  // quantized: every token kept, its mass is all of it
      p.kept += static_cast<double>(n);
      const std::int32_t* rk = &tr.rank[static_cast<std::size_t>(row * T)];
      std::int64_t in_top = 0;
      for (std::int64_t i = 0; i < n; ++i) in_top += rk[ids[i]] < n;
      p.overlap += n > 0 ? static_cast<double>(in_top) / static_cast<double>(n) : 1.0;
      auto has = [&](std::int32_t tok) { return std::binary_search(ids, ids + n, tok); };
      if (!c.needle_of_query.empty()) {
        const std::int32_t target = c.needle_of_query[static_cast<std::size_t>(row)];
        if (target >= 0) {
          p.hits += has(c.needles[static_cast<std::size_t>(target)]);
          p.needle_n += 1;
        }
      } else {
        for (std::int32_t tok : c.needles) {
          p.hits += has(tok);
          p.needle_n += 1;
        }
      }
    }
  });
  Metrics m;
  double hits = 0, needle_n = 0;
  for (const Part& p : parts) {
    m.rel_err += p.rel;
    m.mass_recall += p.mass;
    m.topk_overlap += p.overlap;
    m.kept_tokens += p.kept;
    hits += p.hits;
    needle_n += p.needle_n;
  }
  const double rows = static_cast<double>(Hq) * static_cast<double>(F);
  m.rel_err /= rows;
  m.mass_recall /= rows;
  m.topk_overlap /= rows;
  m.kept_tokens /= rows;
  if (needle_n > 0) m.needle_hit = hits / needle_n;

  // Distinct (kv head, token) pairs per step, averaged over the steps.
  const double elem = static_cast<double>(kvpolicy::dtype_size(c.storage));
  const std::int64_t steps = dec.rows == Decision::Rows::kQueryHeadPerStep ? F : 1;
  std::vector<std::uint8_t> mark(static_cast<std::size_t>(T));
  double pairs = 0;
  for (std::int64_t f = 0; f < steps; ++f)
    for (std::int32_t h = 0; h < c.num_kv_heads; ++h) {
      if (dec.rows == Decision::Rows::kKvHead) {
        pairs += dec.indptr[static_cast<std::size_t>(h + 1)] - dec.indptr[static_cast<std::size_t>(h)];
        continue;
      }
      std::fill(mark.begin(), mark.end(), 0);
      for (std::int32_t g = 0; g < G; ++g) {
        const std::int64_t dr = dec.row_of(c, h * G + g, f);
        for (std::int32_t i = dec.indptr[static_cast<std::size_t>(dr)]; i < dec.indptr[static_cast<std::size_t>(dr + 1)]; ++i)
          mark[static_cast<std::size_t>(dec.indices[static_cast<std::size_t>(i)])] = 1;
      }
      for (auto x : mark) pairs += x;
    }
  m.kv_bytes = pairs / static_cast<double>(steps) * 2.0 * d * elem * dec.bytes_scale + dec.metadata_bytes;
  return m;
}

}  // namespace kvp_compare
