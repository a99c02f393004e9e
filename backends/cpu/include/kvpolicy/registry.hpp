// SPDX-License-Identifier: Apache-2.0
// The run-time registry: every built-in policy by name, with its family, its
// paper and its parameters (from the one `Params::fields()` list), built from
// a spec string, and type-erased one-shot eviction for tools, scripts and
// language bindings.
//
//   AnyEvictionPolicy p;
//   throw_if_error(make_eviction_policy("snapkv:compression_ratio=0.5,window=64", &p));
//   Requirements r = p.requirements(BackendKind::kCpu, shape);
//   p.evict(BackendKind::kCpu, std::span(inputs), keep, Workspace{buf, r.workspace_bytes});
//
// Spec grammar and the typed `make_policy<P>`: kvpolicy/policy/spec.hpp (core,
// backend-free). Errors name the bad key and list the valid ones ("snapkv:
// unknown parameter 'windw'; valid: window, kernel, ...").
//
// Families: `eviction_registry()` lists the policies `make_eviction_policy`
// builds (erased over the backend and the key dtype); `registry()` lists every
// policy of every family, including those with caller-owned state (H2O) or a
// plan (Quest), which are built typed with `make_policy<P>(spec, &p)` since
// their state types are the caller's.
//
// This header belongs to the CPU backend (kvpolicy::cpu): the erased calls
// dispatch to `backend::Cpu` or `backend::Scalar`, and the built-in tables are
// compiled once into the backend's library (src/registry.cpp). Core headers
// never include it, so core stays free of any backend.
// `AnyEvictionPolicy::of(policy)` is header-only, so a user policy that models
// `EvictionPolicy` erases the same way.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/spec.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

/// The backends a type-erased call can run on.
enum class BackendKind : std::uint8_t { kScalar, kCpu };

/// A one-shot eviction policy behind a value type: any `EvictionPolicy` over
/// `ScoreInput<float, Tk>` for Tk in {float, half, bfloat16}, run on the
/// backend named at the call. Copies share the (immutable) policy.
class AnyEvictionPolicy {
 public:
  AnyEvictionPolicy() = default;

  /// `no_scores`: for a policy that is not a Scorer, why it has none (the
  /// message `score` returns names it); ignored for a Scorer.
  template <class P>
  static AnyEvictionPolicy of(P policy, std::string name = P::kName, std::string no_scores = {}) {
    AnyEvictionPolicy a;
    a.impl_ = std::make_shared<const Model<P>>(std::move(policy),
                                               no_scores.empty() ? std::string("it decides without per-token scores") : no_scores);
    a.name_ = std::move(name);
    return a;
  }

  explicit operator bool() const noexcept { return impl_ != nullptr; }
  const std::string& name() const noexcept { return name_; }

  /// Tokens kept per row for a sequence of kv_len tokens (-1 if invalid).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept { return impl_ ? impl_->kept_count(kv_len) : -1; }
  /// Tokens scored +inf by rule (window, sinks).
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return impl_ ? impl_->protected_tokens(kv_len) : 0; }

  Requirements requirements(BackendKind b, const ProblemShape& shape, const ExecContext& exec = {}) const noexcept {
    if (!impl_) return Requirements{KVP_INVALID("AnyEvictionPolicy: empty (no policy assigned)")};
    return impl_->requirements(b, shape, exec);
  }

  /// Whether `score` writes per-token scores (the policy is a Scorer, or an
  /// allocation over one: Ada-KV's scores are its scorer's).
  bool has_scores() const noexcept { return impl_ != nullptr && impl_->has_scores(); }

  /// The size query of `score` for one sequence of `shape` (batch 1): its
  /// workspace in `workspace_bytes`; an error for a policy without scores.
  Requirements score_requirements(BackendKind b, const ProblemShape& shape, const ExecContext& exec = {}) const noexcept {
    if (!impl_) return Requirements{KVP_INVALID("AnyEvictionPolicy: empty (no policy assigned)")};
    return impl_->score_requirements(b, shape, exec);
  }

  /// Per-token scores of one sequence into `out` (num_kv_heads, kv_len):
  /// higher = keep, protected tokens (window, sinks) +inf; the map the policy's
  /// top-k ranks (`evict` keeps each row's best under `score_order_key`).
  /// `ws` holds `score_requirements(...).workspace_bytes`. A policy that is
  /// not a Scorer (StreamingLLM) returns kInvalidArgument saying so.
  template <class Tk>
  Status score(BackendKind b, const ScoreInput<float, Tk>& in, ScoreMap out, Workspace ws, const ExecContext& exec = {}) const noexcept {
    KVP_REQUIRE(impl_ != nullptr, "AnyEvictionPolicy: empty (no policy assigned)");
    return impl_->score(b, in, out, ws, exec);
  }

  template <class Tk>
  Status evict(BackendKind b, std::span<const ScoreInput<float, Tk>> batch, KeepSet out, Workspace ws,
               const ExecContext& exec = {}) const noexcept {
    KVP_REQUIRE(impl_ != nullptr, "AnyEvictionPolicy: empty (no policy assigned)");
    return impl_->evict(b, batch, out, ws, exec);
  }
  template <class Tk>
  Status evict(BackendKind b, const ScoreInput<float, Tk>& in, KeepSet out, Workspace ws, const ExecContext& exec = {}) const noexcept {
    return evict(b, std::span<const ScoreInput<float, Tk>>(&in, 1), out, ws, exec);
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::int64_t kept_count(std::int64_t) const noexcept = 0;
    virtual std::int64_t protected_tokens(std::int64_t) const noexcept = 0;
    virtual Requirements requirements(BackendKind, const ProblemShape&, const ExecContext&) const noexcept = 0;
    virtual Status evict(BackendKind, std::span<const ScoreInput<float, float>>, KeepSet, Workspace, const ExecContext&) const noexcept = 0;
    virtual Status evict(BackendKind, std::span<const ScoreInput<float, half>>, KeepSet, Workspace, const ExecContext&) const noexcept = 0;
    virtual Status evict(BackendKind, std::span<const ScoreInput<float, bfloat16>>, KeepSet, Workspace,
                         const ExecContext&) const noexcept = 0;
    virtual bool has_scores() const noexcept = 0;
    virtual Requirements score_requirements(BackendKind, const ProblemShape&, const ExecContext&) const noexcept = 0;
    virtual Status score(BackendKind, const ScoreInput<float, float>&, ScoreMap, Workspace, const ExecContext&) const noexcept = 0;
    virtual Status score(BackendKind, const ScoreInput<float, half>&, ScoreMap, Workspace, const ExecContext&) const noexcept = 0;
    virtual Status score(BackendKind, const ScoreInput<float, bfloat16>&, ScoreMap, Workspace, const ExecContext&) const noexcept = 0;
  };

  /// Scores through `P::score`; an allocation without its own (`scorer()`) through its scorer's.
  template <class P, class B, class Tk>
  static constexpr bool kScores = Scorer<P, ScoreInput<float, Tk>, B>;

  template <class P>
  struct Model final : Concept {
    Model(P p, std::string why) : policy(std::move(p)), no_scores(std::move(why)) {}
    P policy;
    std::string no_scores;

    bool has_scores() const noexcept override { return kScores<P, backend::Scalar, float>; }
    Requirements score_requirements(BackendKind b, const ProblemShape& s, const ExecContext& exec) const noexcept override {
      if constexpr (!kScores<P, backend::Scalar, float>) {
        return Requirements{KVP_INVALID("%s has no per-token scores: %s", P::kName, no_scores.c_str())};
      } else {
        Requirements r = requirements(b, s, exec);
        if constexpr (requires { policy.scorer(); }) {  // Ada-KV: its scorer's size query covers the scores
          if (r.status.is_ok()) {
            const Requirements sr = b == BackendKind::kCpu ? policy.scorer().requirements(Context<backend::Cpu>{{}, exec}, s)
                                                           : policy.scorer().requirements(Context<backend::Scalar>{{}, exec}, s);
            if (!sr.status.is_ok()) return sr;
            r.workspace_bytes = std::max(r.workspace_bytes, sr.workspace_bytes);
          }
        }
        return r;
      }
    }
    template <class Tk>
    Status run_score(BackendKind b, const ScoreInput<float, Tk>& in, ScoreMap out, Workspace ws, const ExecContext& exec) const noexcept {
      if constexpr (!kScores<P, backend::Scalar, Tk>) {
        return KVP_INVALID("%s has no per-token scores: %s", P::kName, no_scores.c_str());
      } else {
        if (b == BackendKind::kCpu) return policy.score(Context<backend::Cpu>{ws, exec}, in, out);
        if (b == BackendKind::kScalar) return policy.score(Context<backend::Scalar>{ws, exec}, in, out);
        return KVP_INVALID("%s: unknown BackendKind %d", P::kName, static_cast<int>(b));
      }
    }
    Status score(BackendKind b, const ScoreInput<float, float>& x, ScoreMap o, Workspace w, const ExecContext& e) const noexcept override {
      return run_score(b, x, o, w, e);
    }
    Status score(BackendKind b, const ScoreInput<float, half>& x, ScoreMap o, Workspace w, const ExecContext& e) const noexcept override {
      return run_score(b, x, o, w, e);
    }
    Status score(BackendKind b, const ScoreInput<float, bfloat16>& x, ScoreMap o, Workspace w,
                 const ExecContext& e) const noexcept override {
      return run_score(b, x, o, w, e);
    }

    std::int64_t kept_count(std::int64_t n) const noexcept override { return policy.kept_count(n); }
    std::int64_t protected_tokens(std::int64_t n) const noexcept override { return policy.protected_tokens(n); }
    Requirements requirements(BackendKind b, const ProblemShape& s, const ExecContext& exec) const noexcept override {
      if (b == BackendKind::kCpu) return policy.requirements(Context<backend::Cpu>{{}, exec}, s);
      if (b == BackendKind::kScalar) return policy.requirements(Context<backend::Scalar>{{}, exec}, s);
      return Requirements{KVP_INVALID("%s: unknown BackendKind %d", P::kName, static_cast<int>(b))};
    }
    template <class Tk>
    Status run(BackendKind b, std::span<const ScoreInput<float, Tk>> batch, KeepSet out, Workspace ws,
               const ExecContext& exec) const noexcept {
      if (b == BackendKind::kCpu) return policy.evict(Context<backend::Cpu>{ws, exec}, batch, out);
      if (b == BackendKind::kScalar) return policy.evict(Context<backend::Scalar>{ws, exec}, batch, out);
      return KVP_INVALID("%s: unknown BackendKind %d", P::kName, static_cast<int>(b));
    }
    Status evict(BackendKind b, std::span<const ScoreInput<float, float>> x, KeepSet o, Workspace w,
                 const ExecContext& e) const noexcept override {
      return run(b, x, o, w, e);
    }
    Status evict(BackendKind b, std::span<const ScoreInput<float, half>> x, KeepSet o, Workspace w,
                 const ExecContext& e) const noexcept override {
      return run(b, x, o, w, e);
    }
    Status evict(BackendKind b, std::span<const ScoreInput<float, bfloat16>> x, KeepSet o, Workspace w,
                 const ExecContext& e) const noexcept override {
      return run(b, x, o, w, e);
    }
  };

  std::shared_ptr<const Concept> impl_;
  std::string name_;
};

/// One registered policy: what `--list-policies` prints and bindings expose.
struct PolicyInfo {
  std::string_view name;          ///< spec name, e.g. "snapkv"
  std::string_view family;        ///< "eviction", "eviction (online)", "selection", ...
  std::string_view paper;         ///< authors, year, title, arXiv id
  std::vector<ParamInfo> params;  ///< keys with their defaults (spec syntax) and docs
  bool erased = false;            ///< built by make_eviction_policy (else typed: make_policy<P>)
};

/// Every built-in policy of every family, in a fixed order (defined in kvpolicy::cpu).
const std::vector<PolicyInfo>& registry();
/// Builds an erased one-shot eviction policy from a spec string; errors name
/// an unknown policy (listing the known ones) or a bad key / value.
Status make_eviction_policy(std::string_view spec, AnyEvictionPolicy* out);
/// "name  family  paper  key=default ..." lines, one per policy.
std::string describe_registry();

KVP_NAMESPACE_END
