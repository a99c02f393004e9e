// SPDX-License-Identifier: Apache-2.0
// prefetch.hpp compiled once (kvp_engine_lib): the prefetch loop's hooks on
// PagedKVCache<float>, the kvp-tiny InfiniGen adapter, the run and the replay.
#include "prefetch.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "kvpolicy/backends/cpu.hpp"
#include "policies.hpp"

namespace kvp_engine {

using Cache = PagedKVCache<float>;
using Backend = kvpolicy::backend::Cpu;
using kvpolicy::PrefetchRequest;

const char* prefetch_kind_name(PrefetchKind k) noexcept {
  switch (k) {
    case PrefetchKind::kQuestLookahead: return kvpolicy::QuestLookahead<float>::kName;
    case PrefetchKind::kInfiniGen: return kvpolicy::InfiniGen::kName;
    case PrefetchKind::kSpeCache: return kvpolicy::SpeCache::kName;
    case PrefetchKind::kShadowKV: return kvpolicy::ShadowKV::kName;
  }
  return "?";
}
const char* actual_selection_name(ActualSelection a) noexcept { return a == ActualSelection::kQuest ? "quest" : "exact_topk"; }

kvpolicy::Status KvpTinyInfiniGenAdapter::speculative_query(std::int32_t target_layer, const std::int64_t* positions,
                                                            TensorView<const float, 2> x, TensorView<float, 3> q) const {
  const ModelConfig& c = model->config();
  KVP_REQUIRE(target_layer >= 0 && target_layer < c.n_layers, "kvp-tiny infinigen adapter: layer %d out of range", target_layer);
  KVP_REQUIRE(x.extent(1) == c.d_model && q.extent(1) == c.n_heads && q.extent(2) == c.head_dim && x.extent(0) == q.extent(0),
              "kvp-tiny infinigen adapter: x is (%lld, %lld), q (%lld, %lld, %lld); expected (batch, %d) and (batch, %d, %d)",
              static_cast<long long>(x.extent(0)), static_cast<long long>(x.extent(1)), static_cast<long long>(q.extent(0)),
              static_cast<long long>(q.extent(1)), static_cast<long long>(q.extent(2)), c.d_model, c.n_heads, c.head_dim);
  std::vector<float> xr(static_cast<std::size_t>(c.d_model)), qr(static_cast<std::size_t>(c.n_heads * c.head_dim));
  std::vector<float> cs(static_cast<std::size_t>(c.head_dim)), sn(cs.size());
  for (std::int64_t b = 0; b < x.extent(0); ++b) {
    for (int i = 0; i < c.d_model; ++i) xr[static_cast<std::size_t>(i)] = x(b, i);
    linear(xr.data(), model->layer(target_layer).wq, 1, c.d_model, c.n_heads * c.head_dim, qr.data());
    rope_table(positions[b], c.head_dim, c.rope_base, cs.data(), sn.data());
    apply_rope(qr.data(), c.n_heads, c.head_dim, cs.data(), sn.data());
    for (int h = 0; h < c.n_heads; ++h)
      for (int i = 0; i < c.head_dim; ++i) q(b, h, i) = qr[static_cast<std::size_t>(h * c.head_dim + i)];
  }
  return kvpolicy::Status::ok();
}

namespace {

/// Per-layer buffers of whichever policy runs.
struct LayerState {
  std::vector<float> quest_meta;  // PageMetaView::contiguous storage (the real selection and Quest lookahead)
  std::vector<std::int64_t> history;
  std::vector<float> floats;
  std::vector<std::int32_t> ints;
  std::vector<std::uint8_t> codes;
  kvpolicy::QuestLookaheadState<float> ql{};
  kvpolicy::InfiniGenState ig{};
  kvpolicy::SpeCacheState sc{};
  kvpolicy::ShadowKVState sk{};
  // The prediction pending for this layer.
  std::vector<std::int32_t> req_pages;
  std::vector<float> req_prio;
  std::int64_t req_size = 0, req_target = -1;
  bool has_request = false, req_next_layer = false;

  kvpolicy::PageMetaView<float> meta(const Cache& c) {
    const CacheShape& s = c.shape();
    return kvpolicy::PageMetaView<float>::contiguous(quest_meta.data(), c.num_pages(), s.num_kv_heads, s.head_dim);
  }
  kvpolicy::PrefetchHistory& history_of(PrefetchKind k) {
    switch (k) {
      case PrefetchKind::kQuestLookahead: return ql.history;
      case PrefetchKind::kInfiniGen: return ig.history;
      case PrefetchKind::kSpeCache: return sc.history;
      case PrefetchKind::kShadowKV: break;
    }
    return sk.history;
  }
};

struct LoopState {
  const Model* model = nullptr;
  PrefetchLoopOptions opt;
  kvpolicy::QuestLookahead<float> ql;
  kvpolicy::InfiniGen ig;
  kvpolicy::SpeCache sc;
  kvpolicy::ShadowKV sk;
  kvpolicy::Quest actual_quest;
  KvpTinyInfiniGenAdapter adapter;
  std::vector<LayerState> layers;
  std::vector<std::byte> ws;
  std::vector<float> qbuf;                 // InfiniGen's speculative query (1, Hq, hd)
  std::vector<float> page_score;           // kExactTopK: best exact logit per page
  std::vector<std::int32_t> top;           // kExactTopK: selected pages
  std::vector<std::byte> topk_ws;          // kExactTopK: Backend::topk scratch
  std::vector<std::uint8_t> in_selection;  // per pool page: read by this layer step
  std::vector<std::int32_t> marked;
  // SpeCache's speculative row.
  std::int32_t spec_token = -1;
  std::vector<float> xs, xsn, sq, skr, svr, sattn, scores, mlp, logits, krow;
  std::shared_ptr<PrefetchTrace> trace;

  kvpolicy::Context<Backend> ctx() { return kvpolicy::Context<Backend>{kvpolicy::Workspace{ws.data(), ws.size()}, {}}; }

  /// Runs `f` (a predict into L's request buffer) and remembers what it targets.
  template <class F>
  Status predict_into(LayerState& L, bool next_layer, F&& f) {
    PrefetchRequest r{L.req_pages.data(), L.req_prio.data(), static_cast<std::int64_t>(L.req_pages.size()), 0};
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = f(r);
    trace->predict_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++trace->predict_calls;
    KVP_RETURN_IF_ERROR(s);
    L.has_request = true;
    L.req_next_layer = next_layer;
    L.req_size = r.size;
    L.req_target = L.history_of(opt.kind).step;
    return Status::ok();
  }

  /// The real selection of this layer step into `sel` (rows per query head, FlashInfer CSR, logical ids).
  Status select_actual(Cache& c, int layer, TensorView<const float, 3> q, SelectionBuffer& sel) {
    const CacheShape& s = c.shape();
    const auto& view = c.const_view(layer);
    if (opt.actual == ActualSelection::kQuest) {
      const kvpolicy::DecodeInput<float> in{q, view.table, c.page_size(), layer};
      kvpolicy::Quest::Plan plan;
      KVP_RETURN_IF_ERROR(actual_quest.plan(
          ctx(), in, kvpolicy::ProblemShape{.num_q_heads = s.num_q_heads, .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim}, plan));
      sel.reserve(plan.requirements.output.rows, plan.requirements.output.capacity);
      return actual_quest.select(ctx(), plan, in, kvpolicy::PageMetaView<const float>(layers[static_cast<std::size_t>(layer)].meta(c)),
                                 sel.sel);
    }
    // Exact top pages of the real query, per query head: a page scores its best exact logit.
    const std::int32_t n = view.table.num_pages(0), B = opt.page_budget, G = s.num_q_heads / s.num_kv_heads, P = c.page_size();
    const bool all = layer < opt.dense_layers || n <= B;
    const std::int32_t per_row = all ? n : B;
    sel.reserve(s.num_q_heads, static_cast<std::int64_t>(s.num_q_heads) * per_row);
    PageSelection& out = sel.sel;
    const std::int64_t len = view.seq_len(0);
    page_score.resize(static_cast<std::size_t>(std::max(n, 1)));
    top.resize(static_cast<std::size_t>(std::max(n, 1)));
    out.indptr[0] = 0;
    for (int h = 0; h < s.num_q_heads; ++h) {
      std::int32_t* dst = out.indices + out.indptr[h];
      std::int32_t* lg = out.logical + out.indptr[h];
      if (all) {
        for (std::int32_t i = 0; i < n; ++i) top[static_cast<std::size_t>(i)] = i;
      } else {
        for (std::int32_t p = 0; p < n - 1; ++p) {
          float best = -INFINITY;
          for (std::int64_t t = static_cast<std::int64_t>(p) * P; t < std::min<std::int64_t>(len, (p + 1) * static_cast<std::int64_t>(P));
               ++t) {
            const float* k = view.key(0, h / G, t);
            float d = 0.0f;
            for (int i = 0; i < s.head_dim; ++i) d += q(0, h, i) * k[i];
            best = std::max(best, d);
          }
          page_score[static_cast<std::size_t>(p)] = best;
        }
        if (topk_ws.size() < Backend::topk_workspace(n - 1)) topk_ws.resize(Backend::topk_workspace(n - 1));
        Backend::topk(page_score.data(), n - 1, B - 1, top.data(), kvpolicy::Workspace{topk_ws.data(), topk_ws.size()});
        top[static_cast<std::size_t>(B - 1)] = n - 1;
      }
      for (std::int32_t i = 0; i < per_row; ++i) {
        dst[i] = view.table.indices[top[static_cast<std::size_t>(i)]];
        lg[i] = top[static_cast<std::size_t>(i)];
      }
      out.indptr[h + 1] = out.indptr[h] + per_row;
      out.last_page_len[h] = n == 0 ? 0 : view.table.last_page_len[0];
    }
    return Status::ok();
  }

  /// One layer of SpeCache's speculative row (see prefetch.hpp).
  Status speculative_row(Cache& c, int layer) {
    const ModelConfig& cf = model->config();
    const Model::Layer& W = model->layer(layer);
    const int d = cf.d_model, hd = cf.head_dim, Hq = cf.n_heads, Hkv = cf.n_kv_heads, G = cf.group_size();
    LayerState& L = layers[static_cast<std::size_t>(layer)];
    const auto& view = c.const_view(layer);
    const std::int64_t n = view.seq_len(0);
    if (n == 0) return Status::ok();
    if (layer == 0) {
      if (spec_token < 0 || spec_token >= cf.vocab_size)
        return KVP_INVALID("engine specache: the speculative row was not seeded (PrefetchLoop::seed)");
      xs.assign(model->embedding(spec_token), model->embedding(spec_token) + d);
      trace->spec_inputs.push_back(spec_token);
    }
    // The speculative token sits one position after the newest real token.
    const std::int32_t last_page = view.table.indices[view.table.num_pages(0) - 1];
    const std::int64_t pos = c.positions(layer)(last_page, 0, view.table.last_page_len[0] - 1) + 1;
    xsn.resize(static_cast<std::size_t>(d));
    sq.resize(static_cast<std::size_t>(Hq * hd));
    skr.resize(static_cast<std::size_t>(Hkv * hd));
    svr.resize(skr.size());
    sattn.resize(sq.size());
    krow.resize(static_cast<std::size_t>(hd));
    std::vector<float> cs(static_cast<std::size_t>(hd)), sn(cs.size());
    rms_norm(xs.data(), W.attn_norm, 1, d, cf.norm_eps, xsn.data());
    linear(xsn.data(), W.wq, 1, d, Hq * hd, sq.data());
    linear(xsn.data(), W.wk, 1, d, Hkv * hd, skr.data());
    linear(xsn.data(), W.wv, 1, d, Hkv * hd, svr.data());
    rope_table(pos, hd, cf.rope_base, cs.data(), sn.data());
    apply_rope(sq.data(), Hq, hd, cs.data(), sn.data());
    apply_rope(skr.data(), Hkv, hd, cs.data(), sn.data());
    // Its query predicts this layer's pages for the next step.
    const auto qv = TensorView<const float, 3>::contiguous(sq.data(), {1, Hq, hd});
    KVP_RETURN_IF_ERROR(predict_into(L, false, [&](PrefetchRequest& r) {
      return sc.predict(ctx(), L.sc, kvpolicy::DecodeInput<float>{qv, view.table, c.page_size(), layer}, r);
    }));
    // Its attention: low-bit keys outside this step's selection, fp keys inside it, fp values, its own K/V last.
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    scores.resize(static_cast<std::size_t>(n + 1));
    for (int h = 0; h < Hq; ++h) {
      const int g = h / G;
      const float* qh = sq.data() + h * hd;
      float mx = -INFINITY;
      for (std::int64_t t = 0; t <= n; ++t) {
        const float* k = nullptr;
        if (t == n) {
          k = skr.data() + g * hd;
        } else {
          const std::int32_t page = view.table.page_of(0, t, c.page_size());
          if (in_selection[static_cast<std::size_t>(page)]) {
            k = view.key(0, g, t);
          } else {
            sc.dequantize_key<Backend>(L.sc, page, static_cast<std::int32_t>(t % c.page_size()), g, krow.data());
            k = krow.data();
          }
        }
        float dot = 0.0f;
        for (int i = 0; i < hd; ++i) dot += qh[i] * k[i];
        scores[static_cast<std::size_t>(t)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      double sum = 0.0;
      for (std::int64_t t = 0; t <= n; ++t)
        sum += (scores[static_cast<std::size_t>(t)] = std::exp(scores[static_cast<std::size_t>(t)] - mx));
      float* o = sattn.data() + h * hd;
      std::fill(o, o + hd, 0.0f);
      for (std::int64_t t = 0; t <= n; ++t) {
        const float w = static_cast<float>(scores[static_cast<std::size_t>(t)] / sum);
        const float* v = t == n ? svr.data() + g * hd : view.value(0, g, t);
        for (int i = 0; i < hd; ++i) o[i] += w * v[i];
      }
    }
    linear_add(sattn.data(), W.wo, 1, Hq * hd, d, xs.data());
    mlp_block(*model, W, xs.data(), 1, mlp);
    if (layer == cf.n_layers - 1) {
      logits.resize(static_cast<std::size_t>(cf.vocab_size));
      final_logits(*model, xs.data(), 1, logits.data());
      spec_token = argmax(logits);
      trace->speculated.push_back(spec_token);
    }
    return Status::ok();
  }
};

}  // namespace

void PrefetchLoop::seed(std::int32_t first_token) { static_cast<LoopState*>(state.get())->spec_token = first_token; }

PrefetchLoop make_prefetch_loop(const Model& model, const PrefetchLoopOptions& opt, std::int64_t capacity) {
  const ModelConfig& cf = model.config();
  if (opt.page_size < 1 || opt.page_budget < 1 || capacity < 1)
    throw std::runtime_error("prefetch loop: page_size, page_budget and capacity must be >= 1");
  auto S = std::make_shared<LoopState>();
  S->model = &model;
  S->opt = opt;
  S->ql = kvpolicy::QuestLookahead<float>(opt.quest_lookahead);
  S->ig = kvpolicy::InfiniGen(opt.infinigen);
  S->sc = kvpolicy::SpeCache(opt.specache);
  S->sk = kvpolicy::ShadowKV(opt.shadowkv);
  kvpolicy::QuestParams qp;
  qp.page_budget = opt.page_budget;
  qp.dense_layers = opt.dense_layers;
  S->actual_quest = kvpolicy::Quest(qp);
  S->adapter = KvpTinyInfiniGenAdapter{&model};
  const auto pool = static_cast<std::int32_t>((capacity + opt.page_size - 1) / opt.page_size);
  const std::int32_t Hkv = cf.n_kv_heads, hd = cf.head_dim, P = opt.page_size;
  const kvpolicy::ProblemShape shape{.num_q_heads = cf.n_heads, .num_kv_heads = Hkv, .head_dim = hd, .max_kv_len = capacity, .q_len = 1};
  const kvpolicy::Context<Backend> sizing{};
  kvpolicy::Requirements need[2] = {S->actual_quest.requirements(sizing, shape, P), {}};
  switch (opt.kind) {
    case PrefetchKind::kQuestLookahead: need[1] = S->ql.requirements(sizing, shape, P); break;
    case PrefetchKind::kInfiniGen: need[1] = S->ig.requirements(sizing, shape, P); break;
    case PrefetchKind::kSpeCache: need[1] = S->sc.requirements(sizing, shape, P); break;
    case PrefetchKind::kShadowKV: need[1] = S->sk.requirements(sizing, shape, P); break;
  }
  for (const auto& r : need) kvpolicy::throw_if_error(r.status);
  S->ws.resize(std::max(need[0].workspace_bytes, need[1].workspace_bytes));
  S->layers.resize(static_cast<std::size_t>(cf.n_layers));
  for (auto& L : S->layers) {
    L.quest_meta.assign(static_cast<std::size_t>(kvpolicy::PageMetaView<float>::contiguous_size(pool, Hkv, hd)), 0.0f);
    L.history.assign(static_cast<std::size_t>(kvpolicy::PrefetchHistory::buffer_size(pool)), 0);
    L.req_pages.assign(static_cast<std::size_t>(pool), 0);
    L.req_prio.assign(static_cast<std::size_t>(pool), 0.0f);
    switch (opt.kind) {
      case PrefetchKind::kQuestLookahead:
        L.ql.meta = kvpolicy::PageMetaView<float>::contiguous(L.quest_meta.data(), pool, Hkv, hd);
        L.ql.history = kvpolicy::PrefetchHistory::over(L.history.data(), pool);
        break;
      case PrefetchKind::kInfiniGen: {
        const auto n = S->ig.state_size(pool, P, Hkv, hd);
        L.floats.assign(static_cast<std::size_t>(n.floats), 0.0f);
        L.ints.assign(static_cast<std::size_t>(n.ints), 0);
        kvpolicy::throw_if_error(S->ig.make_state(L.floats.data(), L.ints.data(), L.history.data(), pool, P, Hkv, hd, &L.ig));
        break;
      }
      case PrefetchKind::kSpeCache:
        L.codes.assign(static_cast<std::size_t>(S->sc.codes_bytes(pool, P, Hkv, hd)), 0);
        kvpolicy::throw_if_error(S->sc.make_state(L.codes.data(), L.history.data(), pool, P, Hkv, hd, &L.sc));
        break;
      case PrefetchKind::kShadowKV: {
        const auto n = S->sk.state_size(pool, P, Hkv, hd);
        L.floats.assign(static_cast<std::size_t>(n.floats), 0.0f);
        kvpolicy::throw_if_error(S->sk.make_state(L.floats.data(), L.history.data(), pool, P, Hkv, hd, &L.sk));
        break;
      }
    }
  }
  S->qbuf.assign(static_cast<std::size_t>(cf.n_heads * hd), 0.0f);
  S->in_selection.assign(static_cast<std::size_t>(pool), 0);
  S->trace = std::make_shared<PrefetchTrace>();
  S->trace->policy = prefetch_kind_name(opt.kind);
  S->trace->actual = actual_selection_name(opt.actual);
  S->trace->num_layers = cf.n_layers;
  S->trace->pool_pages = pool;
  S->trace->page_bytes = 2.0 * Hkv * P * hd * sizeof(float);
  S->trace->per_layer.assign(static_cast<std::size_t>(cf.n_layers), {});

  PrefetchLoop loop;
  loop.trace = S->trace;
  loop.state = S;
  Hooks<Cache>& h = loop.hooks;
  h.on_append = [S](Cache& c, int layer, std::int64_t appended) -> Status {
    LayerState& L = S->layers[static_cast<std::size_t>(layer)];
    const auto n = static_cast<std::int32_t>(appended);
    const kvpolicy::AppendInput<float> app{c.const_view(layer), &n};
    KVP_RETURN_IF_ERROR(S->actual_quest.on_append(S->ctx(), app, L.meta(c)));
    switch (S->opt.kind) {
      case PrefetchKind::kQuestLookahead: return Status::ok();
      case PrefetchKind::kInfiniGen: return L.ig.prepared ? S->ig.on_append(S->ctx(), app, L.ig) : Status::ok();
      case PrefetchKind::kSpeCache: return S->sc.on_append(S->ctx(), app, L.sc);
      case PrefetchKind::kShadowKV: return S->sk.on_append(S->ctx(), app, L.sk);
    }
    return Status::ok();
  };
  if (opt.kind == PrefetchKind::kInfiniGen) {
    h.after_prefill = [S](Cache& c, int layer, TensorView<const float, 3> queries, KeepBuffer&) -> Status {
      return S->ig.prepare(S->ctx(), queries, c.const_view(layer), S->layers[static_cast<std::size_t>(layer)].ig);
    };
    h.on_layer_input = [S](Cache& c, int layer, std::int64_t position, TensorView<const float, 2> x) -> Status {
      const int target = layer + 1;
      if (target >= c.shape().n_layers) return Status::ok();
      LayerState& T = S->layers[static_cast<std::size_t>(target)];
      const auto q = TensorView<float, 3>::contiguous(S->qbuf.data(), {1, c.shape().num_q_heads, c.shape().head_dim});
      return S->predict_into(T, true, [&](PrefetchRequest& r) {
        return S->ig.predict_from_input(S->ctx(), T.ig, S->adapter, x, &position, c.const_view(target).table, target, q, r);
      });
    };
  }
  h.before_attention = [S](Cache& c, int layer, TensorView<const float, 3> q, SelectionBuffer& sel) -> Status {
    LayerState& L = S->layers[static_cast<std::size_t>(layer)];
    KVP_RETURN_IF_ERROR(S->select_actual(c, layer, q, sel));
    for (auto p : S->marked) S->in_selection[static_cast<std::size_t>(p)] = 0;
    S->marked.clear();
    PrefetchEvent ev;
    ev.layer = layer;
    const PageSelection& a = sel.sel;
    for (std::int32_t i = 0; i < a.indptr[a.num_rows]; ++i) {
      const std::int32_t p = a.indices[i];
      if (S->in_selection[static_cast<std::size_t>(p)]) continue;
      S->in_selection[static_cast<std::size_t>(p)] = 1;
      S->marked.push_back(p);
      ev.needed.push_back(p);
    }
    kvpolicy::PrefetchHistory& hist = L.history_of(S->opt.kind);
    ev.step = hist.step;
    if (L.has_request && L.req_target == hist.step) {
      ev.request.assign(L.req_pages.begin(), L.req_pages.begin() + L.req_size);
      ev.next_layer = L.req_next_layer;
    }
    L.has_request = false;
    kvpolicy::PrefetchCounters& cnt = S->trace->per_layer[static_cast<std::size_t>(layer)];
    switch (S->opt.kind) {
      case PrefetchKind::kQuestLookahead: KVP_RETURN_IF_ERROR(S->ql.observe(S->ctx(), L.ql, a, cnt)); break;
      case PrefetchKind::kInfiniGen: KVP_RETURN_IF_ERROR(S->ig.observe(S->ctx(), L.ig, a, cnt)); break;
      case PrefetchKind::kSpeCache: KVP_RETURN_IF_ERROR(S->sc.observe(S->ctx(), L.sc, a, cnt)); break;
      case PrefetchKind::kShadowKV: KVP_RETURN_IF_ERROR(S->sk.observe(S->ctx(), L.sk, a, cnt)); break;
    }
    S->trace->events.push_back(std::move(ev));
    // Next-step predictors: this query for the next step.
    const kvpolicy::DecodeInput<float> in{q, c.const_view(layer).table, c.page_size(), layer};
    if (S->opt.kind == PrefetchKind::kQuestLookahead)
      return S->predict_into(L, false, [&](PrefetchRequest& r) { return S->ql.predict(S->ctx(), L.ql, in, r); });
    if (S->opt.kind == PrefetchKind::kShadowKV)
      return S->predict_into(L, false, [&](PrefetchRequest& r) { return S->sk.predict(S->ctx(), L.sk, in, r); });
    return Status::ok();
  };
  if (opt.kind == PrefetchKind::kSpeCache) {
    h.after_attention = [S](Cache& c, int layer, TensorView<const float, 2>, KeepBuffer&) -> Status {
      return S->speculative_row(c, layer);
    };
  }
  return loop;
}

PrefetchTrace run_prefetch_loop(const Model& model, const PrefillState& prefill, const PrefetchLoopOptions& opt, int steps) {
  if (steps < 1) throw std::runtime_error("prefetch loop: steps must be >= 1");
  if (opt.kind == PrefetchKind::kInfiniGen && prefill.window < 1) throw std::runtime_error("prefetch loop: infinigen needs prompt queries");
  const ModelConfig& cf = model.config();
  const std::int64_t capacity = prefill.length + steps + 1;
  PrefetchLoop loop = make_prefetch_loop(model, opt, capacity);
  const CacheShape shape{cf.n_layers, cf.n_heads, cf.n_kv_heads, cf.head_dim, capacity};
  Session<Cache> s(model, Cache(shape, opt.page_size), loop.hooks);
  s.load(prefill);
  loop.seed(argmax(s.logits()));
  loop.trace->generated = s.greedy(steps + 1);
  loop.trace->decode_steps = steps;
  return *loop.trace;
}

Status simulate_trace(const PrefetchTrace& trace, kvpolicy::OffloadSimParams params, kvpolicy::OffloadMode mode, double layer_us,
                      kvpolicy::OffloadTotals* out) {
  KVP_REQUIRE(std::isfinite(layer_us) && layer_us > 0.0, "simulate_trace: layer_us is %g, must be finite and > 0", layer_us);
  params.page_bytes = trace.page_bytes;
  kvpolicy::OffloadSim sim;
  KVP_RETURN_IF_ERROR(kvpolicy::OffloadSim::make(params, mode, trace.num_layers, trace.pool_pages, &sim));
  for (const auto& e : trace.events) {
    kvpolicy::OffloadStepReport r;
    const double overlap = e.next_layer ? layer_us : layer_us * std::max(trace.num_layers - 1, 1);
    KVP_RETURN_IF_ERROR(sim.step(e.layer, e.request, e.needed, overlap, &r));
  }
  *out = sim.totals();
  return Status::ok();
}

}  // namespace kvp_engine
