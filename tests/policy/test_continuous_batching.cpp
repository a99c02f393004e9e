// Many sequences per call: every batched entry point decides a batch of
// ragged sequences (contiguous and paged keys, page tables of different
// lengths) in one call, on 1, 2 and 4 threads, exactly as each sequence
// decided alone; then continuous batching over several steps, sequences
// joining and leaving between steps (Quest with per-sequence page metadata,
// TOVA online with a per-sequence compacted cache).
#include <catch2/catch.hpp>

#include <deque>
#include <map>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/policy_test_util.hpp"
#include "policy/selection/quest_fixture.hpp"

namespace {

using B = backend::Cpu;
constexpr std::int64_t kHq = 8, kHkv = 2, kD = 32;

/// Decides `batch` in one call (workspace from `requirements` with shape.batch = batch size, or `ws_batch`).
template <class Policy, class In>
KeepSetBuffer decide(const Policy& p, const std::vector<In>& batch, const ExecContext& ctx, std::int64_t ws_batch = 0) {
  ProblemShape shape{kHq, kHkv, kD, 0, 0};
  std::int64_t total = 0;
  for (const auto& in : batch) {
    shape.max_kv_len = std::max(shape.max_kv_len, in.keys.kv_len());
    shape.q_len = std::max(shape.q_len, in.queries.extent(1));
    total += p.kept_count(in.keys.kv_len()) * kHkv;
  }
  shape.batch = ws_batch > 0 ? ws_batch : static_cast<std::int64_t>(batch.size());
  const Requirements req = p.requirements(Context<B>{{}, ctx}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  KeepSetBuffer keep(static_cast<std::int64_t>(batch.size()) * kHkv, std::max<std::int64_t>(total, 1));
  std::vector<std::byte> ws(req.workspace_bytes);
  const Status s = p.evict(Context<B>{Workspace{ws.data(), ws.size()}, ctx}, std::span<const In>(batch), keep.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return keep;
}

/// The batched decision on 1, 2 and 4 threads equals every sequence decided alone.
template <class Policy, class In>
void check_batch_equals_alone(const Policy& p, const std::vector<In>& batch) {
  std::vector<KeepSetBuffer> alone;
  for (const auto& in : batch) alone.push_back(decide(p, std::vector<In>{in}, ExecContext{}));
  for (int threads : {1, 2, 4}) {
    INFO("threads " << threads);
    ThreadPool pool(threads);
    // The batch as one call, sized for the whole batch and for one sequence (fewer slots: the call runs in waves).
    for (std::int64_t ws_batch : {std::int64_t{0}, std::int64_t{1}}) {
      const KeepSetBuffer got = decide(p, batch, pool.context(), ws_batch);
      for (std::size_t b = 0; b < batch.size(); ++b) {
        INFO("sequence " << b << ", kv_len " << batch[b].keys.kv_len());
        for (std::int64_t h = 0; h < kHkv; ++h) REQUIRE(got.row(static_cast<std::int64_t>(b) * kHkv + h) == alone[b].row(h));
      }
    }
  }
}

/// Sequences of ragged lengths, every other one in a page pool of its own (different page counts).
struct RaggedBatch {
  std::deque<RandomCase<half>> cases;  // stable addresses: inputs point into them
  std::vector<ScoreInput<float, half>> inputs;
  RaggedBatch(const std::vector<std::int64_t>& lens, std::int64_t window, bool paged, unsigned seed) {
    for (std::size_t i = 0; i < lens.size(); ++i) {
      const std::int64_t w = window < 0 ? lens[i] : window;  // < 0: the whole prompt as queries
      cases.emplace_back(kHq, kHkv, lens[i], kD, w, seed + static_cast<unsigned>(i));
      inputs.push_back(paged && i % 2 == 1 ? cases.back().paged_input(static_cast<std::int32_t>(4 + 3 * i)) : cases.back().input());
    }
  }
};

/// A scorer without the per-head hook (SnapKV's scores through `score` only): `Budgeted` then splits by sequence.
struct SnapKVScoreOnly {
  SnapKV snap;
  Status validate_params() const noexcept { return snap.validate_params(); }
  std::int64_t protected_tokens(std::int64_t n) const noexcept { return snap.protected_tokens(n); }
  template <class Bk>
  Requirements requirements(const Context<Bk>& c, const ProblemShape& s) const noexcept {
    return snap.requirements(c, s);
  }
  template <class Bk, class Tq, class Tk>
  Status score(const Context<Bk>& c, const ScoreInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    return snap.score(c, in, out);
  }
  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape) const noexcept {
    return snap.validate(batch, shape);
  }
};
static_assert(RowScorer<SnapKV, B> && RowScorer<ExpectedAttention, B> && !RowScorer<SnapKVScoreOnly, B>);

/// `Budgeted<S, LayerAllocation>` as an EvictionPolicy (PyramidKV's composition over any scorer).
template <class S>
struct PyramidOver {
  Budgeted<S, LayerAllocation> composed;
  std::int64_t kept_count(std::int64_t n) const noexcept { return composed.kept_count("pyramid_over", n); }
  Requirements requirements(const Context<B>& c, const ProblemShape& s) const noexcept {
    return composed.requirements("pyramid_over", c, s);
  }
  template <class In>
  Status evict(const Context<B>& c, std::span<const In> batch, KeepSet out) const noexcept {
    return composed.evict("pyramid_over", c, batch, out);
  }
};

}  // namespace

TEST_CASE("continuous batching: SnapKV over ragged contiguous and paged sequences equals each alone", "[batching][snapkv]") {
  const RaggedBatch rb({300, 16, 2048, 17, 900}, 16, /*paged=*/true, 11);
  check_batch_equals_alone(SnapKV(SnapKVParams::kvpress(0.6, 16, 5)), rb.inputs);
  check_batch_equals_alone(SnapKV(SnapKVParams::original(128, 16, 7, Pooling::kMax)), rb.inputs);
}

TEST_CASE("continuous batching: PyramidKV and Budgeted scorers equal each sequence alone", "[batching][pyramidkv]") {
  const RaggedBatch rb({300, 16, 2048, 17, 900}, 16, /*paged=*/true, 23);
  for (std::int32_t layer : {0, 5, 11}) {
    INFO("layer " << layer);
    const PyramidKV pyr(PyramidKVParams::kvpress(0.5, layer, 12, 16, 5));
    check_batch_equals_alone(pyr, rb.inputs);
    // The same composition over a scorer without the per-head hook (split by sequence), and equal to PyramidKV.
    const SnapKV snap(SnapKVParams::kvpress(0.0, 16, 5));
    const PyramidOver<SnapKVScoreOnly> over{
        Budgeted<SnapKVScoreOnly, LayerAllocation>(SnapKVScoreOnly{snap}, LayerAllocation{pyr.params().schedule, layer, 0})};
    check_batch_equals_alone(over, rb.inputs);
    ThreadPool pool(2);
    REQUIRE(decide(over, rb.inputs, pool.context()) == decide(pyr, rb.inputs, pool.context()));
  }
}

TEST_CASE("continuous batching: TOVA and ObservedAttention and StreamingLLM equal each sequence alone", "[batching][tova]") {
  const RaggedBatch rb({300, 1, 2048, 17, 900}, 1, /*paged=*/true, 37);
  check_batch_equals_alone(TOVA(TOVAParams::kvpress(0.5)), rb.inputs);
  check_batch_equals_alone(TOVA(TOVAParams::original(64)), rb.inputs);
  // Fewer sequences than workers: one wave of (sequence, kv head) items.
  check_batch_equals_alone(TOVA(TOVAParams::original(64)), std::vector<ScoreInput<float, half>>(rb.inputs.begin(), rb.inputs.begin() + 3));
  check_batch_equals_alone(StreamingLLM(StreamingLLMParams::kvpress(0.5, 4)), rb.inputs);
  check_batch_equals_alone(StreamingLLM(StreamingLLMParams::original(4, 64)), rb.inputs);
  // A batch that keeps more than the threshold of the parallel row writes.
  const RaggedBatch big({40000, 30000, 17}, 1, /*paged=*/false, 41);
  check_batch_equals_alone(StreamingLLM(StreamingLLMParams::kvpress(0.25, 4)), big.inputs);

  const RaggedBatch prompts({300, 1, 1024, 17}, -1, /*paged=*/true, 43);  // ObservedAttention reads the whole prompt
  ObservedAttentionParams op = ObservedAttentionParams::kvpress(0.5);
  op.window = 0;
  check_batch_equals_alone(ObservedAttention(op), prompts.inputs);
}

TEST_CASE("continuous batching: ExpectedAttention over ragged sequences equals each alone", "[batching][expected_attention]") {
  const RaggedBatch rb({300, 5, 2048, 17, 900}, 5, /*paged=*/true, 53);
  std::deque<std::vector<half>> values;
  std::vector<ExpectedAttentionInput<float, half>> batch;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < rb.inputs.size(); ++i) {
    const std::int64_t T = rb.inputs[i].keys.kv_len();
    values.emplace_back(static_cast<std::size_t>(kHkv * T * kD));
    for (auto& x : values.back()) x = from_float<half>(nd(rng));
    ExpectedAttentionInput<float, half> in;
    in.queries = rb.inputs[i].queries;
    in.keys = rb.inputs[i].keys;
    in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.back().data(), {kHkv, T, kD}));
    batch.push_back(in);
  }
  const ExpectedAttention ea(ExpectedAttentionParams::kvpress(0.5, 64, 4));
  check_batch_equals_alone(ea, batch);
  // Through Budgeted (the per-head hook): PyramidKV's schedule over Expected Attention's scores.
  const PyramidOver<ExpectedAttention> over{
      Budgeted<ExpectedAttention, LayerAllocation>(ea, LayerAllocation{LayerSchedule::pyramid_kvpress(0.5, 4, 8), 2, 0})};
  check_batch_equals_alone(over, batch);
}

namespace {

/// Quest over a shared page pool: sequences live in slots of one cache; a step's batch is any subset of slots.
struct QuestWorld {
  quest_test::PagedCache<half> cache;
  quest_test::MetaBuffer<half> meta;
  QuestWorld(std::int32_t pages, std::int32_t slots, unsigned seed)
      : cache(pages, kHkv, 16, kD, PageLayout::kNHD, slots, seed), meta(pages, kHkv, kD) {}

  /// Appends n_b tokens to each slot b with n_b > 0 and updates the metadata (one on_append over all slots).
  void append(const std::vector<std::int32_t>& n) {
    for (std::int32_t b = 0; b < cache.batch(); ++b)
      if (n[static_cast<std::size_t>(b)] > 0) cache.append_normal(b, n[static_cast<std::size_t>(b)]);
    const Status s = Quest{}.on_append(Context<B>{}, AppendInput<half>{cache.view(), n.data()}, meta.view());
    INFO(s.message());
    REQUIRE(s.is_ok());
  }
  /// The slot leaves: its pages go back to the pool (a joiner may reuse them).
  void release(std::int32_t b) {
    auto& sp = cache.seq_pages[static_cast<std::size_t>(b)];
    cache.free_pages.insert(cache.free_pages.end(), sp.begin(), sp.end());
    sp.clear();
    cache.seq_len[static_cast<std::size_t>(b)] = 0;
    cache.rebuild_table();
  }
};

struct Selection {
  quest_test::SelectionBuffer buf{0, 0};
  std::int64_t H = 0;
};

/// Quest select over the slots `seqs` (in that order) with queries (seqs, Hq, d).
Selection quest_select(const Quest& quest, const QuestWorld& w, const std::vector<std::int32_t>& seqs, const std::vector<float>& q,
                       int layer, const ExecContext& ctx) {
  std::vector<std::int32_t> indptr{0}, indices, last;
  for (std::int32_t s : seqs) {
    const auto& sp = w.cache.seq_pages[static_cast<std::size_t>(s)];
    indices.insert(indices.end(), sp.begin(), sp.end());
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(w.cache.last[static_cast<std::size_t>(s)]);
  }
  const PageTable table{indptr.data(), indices.data(), last.data(), static_cast<std::int32_t>(seqs.size())};
  const auto nb = static_cast<std::int64_t>(seqs.size());
  const DecodeInput<float> in{TensorView<const float, 3>::contiguous(q.data(), {nb, kHq, kD}), table, 16, layer};
  Quest::Plan plan;
  REQUIRE(quest.plan(Context<B>{{}, ctx}, in, ProblemShape{.num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kD}, plan).is_ok());
  Selection out;
  out.H = quest.heads_per_seq(GqaMap{kHq, kHkv});
  out.buf = quest_test::SelectionBuffer(plan.requirements.output.rows, plan.requirements.output.capacity);
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  const Status s = quest.select(Context<B>{Workspace{ws.data(), ws.size()}, ctx}, plan, in, w.meta.cview(), out.buf.view());
  INFO(s.message());
  REQUIRE(s.is_ok());
  return out;
}

/// The step's batched selection on 1, 2 and 4 threads equals each sequence selected alone.
void check_quest_step(const Quest& quest, const QuestWorld& w, const std::vector<std::int32_t>& seqs, int layer, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(seqs.size() * kHq * kD);
  for (auto& x : q) x = nd(rng);
  std::vector<Selection> alone;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    alone.push_back(quest_select(quest, w, {seqs[i]}, std::vector<float>(q.begin() + i * kHq * kD, q.begin() + (i + 1) * kHq * kD), layer,
                                 ExecContext{}));
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    const Selection got = quest_select(quest, w, seqs, q, layer, pool.context());
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("threads " << threads << ", slot " << seqs[i] << ", " << w.cache.seq_len[static_cast<std::size_t>(seqs[i])] << " tokens");
      for (std::int64_t h = 0; h < got.H; ++h) {
        const std::int64_t r = static_cast<std::int64_t>(i) * got.H + h;
        REQUIRE(got.buf.row(r) == alone[i].buf.row(h));
        REQUIRE(got.buf.row_logical(r) == alone[i].buf.row_logical(h));
        REQUIRE(got.buf.last[static_cast<std::size_t>(r)] == alone[i].buf.last[static_cast<std::size_t>(h)]);
      }
    }
  }
}

}  // namespace

TEST_CASE("continuous batching: Quest select over page tables of different lengths equals each sequence alone", "[batching][quest]") {
  QuestWorld w(400, 5, 61);
  w.append({300, 1, 2048, 17, 900});  // 19, 1, 128, 2 and 57 pages
  for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion}) {
    QuestParams qp;
    qp.budget = Budget::tokens(128);
    qp.gqa = mode;
    for (int layer : {0, 3}) check_quest_step(Quest(qp), w, {0, 1, 2, 3, 4}, layer, 7u + static_cast<unsigned>(layer));
  }
}

TEST_CASE("continuous batching: Quest steps with sequences joining and leaving equal per-sequence selection", "[batching][quest]") {
  QuestWorld w(600, 6, 67);
  QuestParams qp;
  qp.budget = Budget::tokens(96);
  const Quest quest(qp);
  // Per step: slots joining (their prompt appended) and slots leaving (pages back to the pool, reused by later
  // joiners); every other active slot decodes one token.
  std::vector<bool> active(6, false);
  const std::vector<std::map<std::int32_t, std::int32_t>> joins = {{{0, 300}, {1, 17}, {2, 1}}, {{3, 2048}}, {}, {{4, 40}}, {{5, 700}},
                                                                   {{2, 33}, {1, 129}}};
  const std::vector<std::vector<std::int32_t>> leaves = {{}, {}, {2}, {}, {1, 3}, {0}};
  for (std::size_t step = 0; step < joins.size(); ++step) {
    INFO("step " << step);
    for (std::int32_t s : leaves[step]) {
      w.release(s);
      active[static_cast<std::size_t>(s)] = false;
    }
    std::vector<std::int32_t> n(6, 0);
    for (std::int32_t s = 0; s < 6; ++s)
      if (active[static_cast<std::size_t>(s)]) n[static_cast<std::size_t>(s)] = 1;  // decode step
    for (const auto& [s, len] : joins[step]) {
      n[static_cast<std::size_t>(s)] = len;
      active[static_cast<std::size_t>(s)] = true;
    }
    w.append(n);
    std::vector<std::int32_t> seqs;
    for (std::int32_t s = 5; s >= 0; --s)  // any order of slots
      if (active[static_cast<std::size_t>(s)]) seqs.push_back(s);
    REQUIRE(!seqs.empty());
    check_quest_step(quest, w, seqs, 4, 100u + static_cast<unsigned>(step));
  }
}

TEST_CASE("continuous batching: TOVA online with per-sequence caches carried across steps with joins and leaves", "[batching][tova]") {
  // Each sequence's state is its compacted key cache (Hkv, len, d); every step appends one token, TOVA decides the
  // whole current batch in one call, and each sequence keeps the tokens of its rows (equal for every kv head).
  struct Seq {
    std::vector<float> keys;  // (Hkv, len, d)
    std::int64_t len = 0;
    std::vector<float> q;  // (Hq, 1, d) this step's query
  };
  std::mt19937 rng(71);
  std::normal_distribution<float> nd;
  auto grow = [&](Seq& s, std::int64_t n) {
    std::vector<float> k(static_cast<std::size_t>(kHkv * (s.len + n) * kD));
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (std::int64_t t = 0; t < s.len + n; ++t)
        for (std::int64_t c = 0; c < kD; ++c)
          k[static_cast<std::size_t>((h * (s.len + n) + t) * kD + c)] =
              t < s.len ? s.keys[static_cast<std::size_t>((h * s.len + t) * kD + c)] : nd(rng);
    s.keys.swap(k);
    s.len += n;
    s.q.resize(static_cast<std::size_t>(kHq * kD));
    for (auto& x : s.q) x = nd(rng);
  };
  const TOVA tova(TOVAParams::original(48));
  std::map<int, Seq> live;
  int next_id = 0;
  for (int step = 0; step < 12; ++step) {
    INFO("step " << step);
    if (step % 3 == 0) grow(live[next_id++], step == 0 ? 100 : 7 * step);  // a sequence joins with its prompt
    if (step == 5) live.erase(live.begin());                               // the oldest leaves
    if (step == 9) live.erase(std::next(live.begin()));
    for (auto& [id, s] : live)
      if (!(step % 3 == 0 && id == next_id - 1)) grow(s, 1);  // decode: one token each (not the sequence that just joined)
    std::vector<ScoreInput<float, float>> batch;
    for (auto& [id, s] : live)
      batch.push_back({TensorView<const float, 3>::contiguous(s.q.data(), {kHq, 1, kD}),
                       KVSource<float>::from(TensorView<const float, 3>::contiguous(s.keys.data(), {kHkv, s.len, kD}))});
    std::vector<KeepSetBuffer> alone;
    for (const auto& in : batch) alone.push_back(decide(tova, std::vector<ScoreInput<float, float>>{in}, ExecContext{}));
    ThreadPool pool(2 + step % 3);
    const KeepSetBuffer got = decide(tova, batch, pool.context());
    std::size_t i = 0;
    for (auto& [id, s] : live) {
      for (std::int64_t h = 0; h < kHkv; ++h) REQUIRE(got.row(static_cast<std::int64_t>(i) * kHkv + h) == alone[i].row(h));
      // Carry the state: keep the chosen tokens (row 0; every kv head keeps the same ids).
      const auto keep = got.row(static_cast<std::int64_t>(i) * kHkv);
      std::vector<float> k(static_cast<std::size_t>(kHkv) * keep.size() * kD);
      for (std::int64_t h = 0; h < kHkv; ++h)
        for (std::size_t t = 0; t < keep.size(); ++t)
          for (std::int64_t c = 0; c < kD; ++c)
            k[(static_cast<std::size_t>(h) * keep.size() + t) * kD + static_cast<std::size_t>(c)] =
                s.keys[static_cast<std::size_t>((h * s.len + keep[t]) * kD + c)];
      s.keys.swap(k);
      s.len = static_cast<std::int64_t>(keep.size());
      REQUIRE(s.len <= 48);
      ++i;
    }
  }
}
