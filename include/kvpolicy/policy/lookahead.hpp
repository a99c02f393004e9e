// SPDX-License-Identifier: Apache-2.0
// Lookahead queries: queries of positions the model has not reached yet, used
// as (part of) an observation window. LAQ (Lookahead Q-Cache, EMNLP 2025,
// arXiv 2505.20334) gets them by greedily decoding a few pseudo tokens on a
// cheap compressed cache; a draft model or a learned predictor could supply
// them the same way. Any query-window scorer reads them through
// `ScoreInput::lookahead` (SnapKV, and through it Ada-KV and PyramidKV;
// Expected Attention takes them as further samples of the query
// distribution).
//
//   LookaheadDecoder dec(LookaheadParams{.max_tokens = 8, .eos_id = eos});
//   Requirements r = dec.requirements(shape);                // staging workspace
//   dec.run(ws, shape, first_token, T, step, out, tokens, &n);  // n pseudo tokens' queries
//   lookahead_observation(prompt_q, out.narrow(0, l * Hq, Hq).narrow(1, 0, n), W2, obs);  // layer l
//
// The engine supplies one callback, `step(token, position, &out)`: decode
// `token` at `position` on its stage-1 cache and point `out` at that token's
// post-RoPE queries of every layer and its next-token logits. The library
// owns the loop (greedy, EOS, counts), checks every step and writes nothing
// when a step fails.
//
// Decode loop (the LAQ repository's `LlamaForCausalLM_forward_LAQ`): the first
// token is the argmax of the prefill logits; each forward appends the token's
// queries; the loop stops after `max_tokens` forwards, or as soon as a
// forward's argmax is EOS (that EOS is not fed). So n = max_tokens unless EOS
// comes first, and n >= 1. Argmax ties go to the lowest token id (torch's
// argmax). The pseudo tokens' K/V stay in the engine's stage-1 cache, which
// the engine drops afterwards.
//
// Causal mask of lookahead rows (`LookaheadMask`). An observation window of w
// prompt queries (positions T-w .. T-1) followed by n lookahead queries
// (positions T .. T+n-1) over T prompt keys:
//  * kCorrected: prompt query T-w+i sees keys <= T-w+i, every lookahead query
//    sees all T keys (the positions the queries really have);
//  * kReference: the LAQ repository's `update_kv_LAQ` adds a causal mask to the
//    last (w+n) x (w+n) block as if all w+n rows were the last prompt
//    positions: row i sees keys <= T-(w+n)+i. Prompt queries lose n keys they
//    may see, and pseudo query i misses the last w+n-1-i prompt keys (mostly
//    the protected window). Needs T >= w+n.
// Both softmaxes run over prompt keys only (the pseudo tokens' own keys are
// not scored), as in the reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <span>

#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/workspace.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

/// Causal positions of lookahead query rows (see the header comment).
enum class LookaheadMask : std::uint8_t {
  kCorrected,  ///< prompt rows at T-w.., lookahead rows see every prompt key
  kReference,  ///< the LAQ repository's mask: all w+n rows at the last w+n prompt positions
};
inline constexpr EnumName<LookaheadMask> kLookaheadMaskNames[] = {{"corrected", LookaheadMask::kCorrected},
                                                                  {"reference", LookaheadMask::kReference}};
constexpr std::span<const EnumName<LookaheadMask>> enum_names(LookaheadMask) noexcept { return kLookaheadMaskNames; }

/// `WindowScoreShape::q_pos0` for `rows` observation rows of which the first
/// `window` are the last prompt queries of a T-token prompt.
constexpr std::int64_t lookahead_query_pos0(LookaheadMask mask, std::int64_t kv_len, std::int64_t window, std::int64_t rows) noexcept {
  return mask == LookaheadMask::kReference ? kv_len - rows : kv_len - window;
}

/// One pseudo token's forward, as the engine's callback reports it.
struct LookaheadStep {
  TensorView<const float, 3> queries{};  ///< (num_layers, num_q_heads, head_dim): the token's post-RoPE queries
  std::span<const float> logits{};       ///< (vocab): the next-token logits after it
};

/// The engine's callback: decode `token` at logical `position` on its stage-1
/// cache, point `out` at the result (valid until the next call), return its Status.
using LookaheadDecodeFn = std::function<Status(std::int32_t token, std::int64_t position, LookaheadStep& out)>;

struct LookaheadParams {
  std::int32_t max_tokens = 8;  ///< forwards at most (LAQ's max_lookahead_size)
  std::int32_t eos_id = -1;     ///< stop when a forward's argmax is this token (-1: never)
};

/// The model dimensions a lookahead decode reports.
struct LookaheadShape {
  std::int64_t num_layers = 0, num_q_heads = 0, head_dim = 0, vocab = 0;
};

/// Greedy pseudo-token decoding through the engine's callback (header comment).
class LookaheadDecoder {
 public:
  using Params = LookaheadParams;
  static constexpr const char* kName = "lookahead";

  constexpr LookaheadDecoder() noexcept = default;
  explicit constexpr LookaheadDecoder(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.max_tokens >= 1, "lookahead: max_tokens is %d, must be >= 1", params_.max_tokens);
    KVP_REQUIRE(params_.eos_id >= -1, "lookahead: eos_id is %d, must be a token id or -1", params_.eos_id);
    return Status::ok();
  }

  /// Staging workspace of `run` (the queries and tokens are written to the
  /// outputs only once every step succeeded); output rows = layers x q heads,
  /// capacity = max_tokens.
  Requirements requirements(const LookaheadShape& s) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok()) r.status = check_shape(s);
    if (!r.status.is_ok()) return r;
    r.workspace_bytes = WorkspacePlan{}
                            .add<float>(static_cast<std::size_t>(s.num_layers * s.num_q_heads * params_.max_tokens * s.head_dim))
                            .add<std::int32_t>(static_cast<std::size_t>(params_.max_tokens))
                            .total();
    r.output = OutputSize{s.num_layers * s.num_q_heads, params_.max_tokens};
    return r;
  }

  /// Decodes from `first_token` (the prefill's argmax) at `first_position`
  /// (the prompt length). On success `out` (num_layers * num_q_heads,
  /// >= max_tokens, head_dim) holds, in row `l * num_q_heads + h`, the n
  /// pseudo queries of layer l, head h in rows [0, n); `tokens[0..n)` the
  /// tokens fed; `*count` = n. On error nothing is written.
  Status run(Workspace ws, const LookaheadShape& s, std::int32_t first_token, std::int64_t first_position, const LookaheadDecodeFn& step,
             TensorView<float, 3> out, std::span<std::int32_t> tokens, std::int64_t* count) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_shape(s));
    KVP_REQUIRE(static_cast<bool>(step), "lookahead: the decode callback is empty");
    KVP_REQUIRE(count != nullptr, "lookahead: count is null");
    KVP_REQUIRE(first_token >= 0 && first_token < s.vocab, "lookahead: first_token %d is outside the vocabulary [0, %lld)", first_token,
                static_cast<long long>(s.vocab));
    KVP_REQUIRE(first_position >= 0, "lookahead: first_position is %lld, must be >= 0", static_cast<long long>(first_position));
    const std::int64_t rows = s.num_layers * s.num_q_heads, n_max = params_.max_tokens, d = s.head_dim;
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "out"));
    KVP_REQUIRE(out.extent(0) == rows && out.extent(1) >= n_max && out.extent(2) == d,
                "lookahead: out has shape (%lld, %lld, %lld), expected (num_layers * num_q_heads = %lld, >= max_tokens = %lld, head_dim = "
                "%lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(out.extent(2)),
                static_cast<long long>(rows), static_cast<long long>(n_max), static_cast<long long>(d));
    KVP_REQUIRE(static_cast<std::int64_t>(tokens.size()) >= n_max, "lookahead: tokens holds %zu ids, needs max_tokens = %lld",
                tokens.size(), static_cast<long long>(n_max));
    const Requirements req = requirements(s);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, req.workspace_bytes));
    WorkspaceCarver c(ws);
    float* staged = c.take<float>(static_cast<std::size_t>(rows * n_max * d));  // (rows, n_max, d)
    std::int32_t* fed = c.take<std::int32_t>(static_cast<std::size_t>(n_max));

    std::int32_t token = first_token;
    std::int64_t n = 0;
    for (;;) {
      LookaheadStep st;
      Status s_call = Status::ok();
      try {
        s_call = step(token, first_position + n, st);
      } catch (const std::exception& e) {
        return KVP_INVALID("lookahead: the decode callback threw at pseudo token %lld: %s", static_cast<long long>(n), e.what());
      } catch (...) {
        return KVP_INVALID("lookahead: the decode callback threw at pseudo token %lld", static_cast<long long>(n));
      }
      if (!s_call.is_ok()) return s_call;
      KVP_RETURN_IF_ERROR(check_step(st, s, n));
      fed[n] = token;
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < d; ++j) staged[(r * n_max + n) * d + j] = st.queries(r / s.num_q_heads, r % s.num_q_heads, j);
      ++n;
      const std::int32_t next = argmax(st.logits);
      if (n == n_max || next == params_.eos_id) break;
      token = next;
    }
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < d; ++j) out(r, i, j) = staged[(r * n_max + i) * d + j];
    std::memcpy(tokens.data(), fed, static_cast<std::size_t>(n) * sizeof(std::int32_t));
    *count = n;
    return Status::ok();
  }

  /// Greedy choice: the largest logit, the lowest id on ties (torch.argmax).
  static std::int32_t argmax(std::span<const float> logits) noexcept {
    std::int32_t best = 0;
    for (std::size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[static_cast<std::size_t>(best)]) best = static_cast<std::int32_t>(i);
    return best;
  }

 private:
  static Status check_shape(const LookaheadShape& s) noexcept {
    KVP_REQUIRE(s.num_layers >= 1 && s.num_q_heads >= 1 && s.head_dim >= 1 && s.vocab >= 1,
                "lookahead: shape (layers %lld, q heads %lld, head_dim %lld, vocab %lld) must be all >= 1",
                static_cast<long long>(s.num_layers), static_cast<long long>(s.num_q_heads), static_cast<long long>(s.head_dim),
                static_cast<long long>(s.vocab));
    KVP_REQUIRE(s.vocab <= INT32_MAX, "lookahead: vocab %lld exceeds the int32 token id range", static_cast<long long>(s.vocab));
    return Status::ok();
  }

  static Status check_step(const LookaheadStep& st, const LookaheadShape& s, std::int64_t n) noexcept {
    const auto& q = st.queries;
    KVP_REQUIRE(q.data() != nullptr, "lookahead: the callback returned null queries at pseudo token %lld", static_cast<long long>(n));
    KVP_REQUIRE(q.extent(0) == s.num_layers && q.extent(1) == s.num_q_heads && q.extent(2) == s.head_dim,
                "lookahead: the callback returned queries of shape (%lld, %lld, %lld) at pseudo token %lld, expected (num_layers = %lld, "
                "num_q_heads = %lld, head_dim = %lld)",
                static_cast<long long>(q.extent(0)), static_cast<long long>(q.extent(1)), static_cast<long long>(q.extent(2)),
                static_cast<long long>(n), static_cast<long long>(s.num_layers), static_cast<long long>(s.num_q_heads),
                static_cast<long long>(s.head_dim));
    KVP_REQUIRE(static_cast<std::int64_t>(st.logits.size()) == s.vocab && st.logits.data() != nullptr,
                "lookahead: the callback returned %zu logits at pseudo token %lld, expected vocab = %lld", st.logits.size(),
                static_cast<long long>(n), static_cast<long long>(s.vocab));
    for (std::int64_t l = 0; l < s.num_layers; ++l)
      for (std::int64_t h = 0; h < s.num_q_heads; ++h)
        for (std::int64_t j = 0; j < s.head_dim; ++j)
          KVP_REQUIRE(std::isfinite(q(l, h, j)),
                      "lookahead: the callback returned a non-finite query (layer %lld, head %lld) at pseudo token %lld",
                      static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(n));
    for (float v : st.logits)
      KVP_REQUIRE(std::isfinite(v), "lookahead: the callback returned non-finite logits at pseudo token %lld", static_cast<long long>(n));
    return Status::ok();
  }

  Params params_{};
};

/// The observation rows of one layer: the last `window` rows of
/// `prompt_queries` (num_q_heads, W >= window, head_dim) followed by the n
/// rows of `lookahead` (num_q_heads, n, head_dim) into `out`
/// (num_q_heads, window + n, head_dim). Nothing written on error.
inline Status lookahead_observation(TensorView<const float, 3> prompt_queries, TensorView<const float, 3> lookahead, std::int64_t window,
                                    TensorView<float, 3> out) noexcept {
  KVP_RETURN_IF_ERROR(prompt_queries.check_basic("lookahead_observation", "prompt_queries"));
  KVP_RETURN_IF_ERROR(lookahead.check_basic("lookahead_observation", "lookahead"));
  KVP_RETURN_IF_ERROR(out.check_basic("lookahead_observation", "out"));
  const std::int64_t H = prompt_queries.extent(0), d = prompt_queries.extent(2), n = lookahead.extent(1);
  KVP_REQUIRE(window >= 0 && window <= prompt_queries.extent(1),
              "lookahead_observation: window %lld must be in [0, prompt query rows = %lld]", static_cast<long long>(window),
              static_cast<long long>(prompt_queries.extent(1)));
  KVP_REQUIRE(lookahead.extent(0) == H && lookahead.extent(2) == d,
              "lookahead_observation: lookahead has (heads, head_dim) = (%lld, %lld), prompt_queries (%lld, %lld)",
              static_cast<long long>(lookahead.extent(0)), static_cast<long long>(lookahead.extent(2)), static_cast<long long>(H),
              static_cast<long long>(d));
  KVP_REQUIRE(out.extent(0) == H && out.extent(1) == window + n && out.extent(2) == d,
              "lookahead_observation: out has shape (%lld, %lld, %lld), expected (%lld, window + n = %lld, %lld)",
              static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(out.extent(2)),
              static_cast<long long>(H), static_cast<long long>(window + n), static_cast<long long>(d));
  const std::int64_t W = prompt_queries.extent(1);
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t i = 0; i < window; ++i)
      for (std::int64_t j = 0; j < d; ++j) out(h, i, j) = prompt_queries(h, W - window + i, j);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < d; ++j) out(h, window + i, j) = lookahead(h, i, j);
  }
  return Status::ok();
}

KVP_NAMESPACE_END
