// SPDX-License-Identifier: Apache-2.0
// kvpolicy — the umbrella header: everything a CPU user needs.
//
//   #include <kvpolicy/kvpolicy.hpp>
//
// brings the core views and status, the ops contract and its scalar
// reference, every policy of every family that exists (eviction: StreamingLLM,
// SnapKV, H2O, ObservedAttention, TOVA, Ada-KV, PyramidKV, Expected Attention, LAQ;
// selection: Quest; quantization: ggml blocks (optionally Hadamard-rotated), fp8, KIVI,
// token-wise INT4 with Hadamard rotation; merging: kvpress
// MergingPress / CAMPress, CaM, D2O, LOOK-M pivot, nearest-kept, MiniCache;
// prefetch: Quest lookahead, InfiniGen, SpeCache, ShadowKV-style landmarks),
// the evict -> merge -> quantize pipeline, the budget vocabulary, the apply/
// helpers that compact and merge a cache, the engine lifecycle hooks, the run-time registry, the owning
// convenience layer (easy.hpp), the thread pool and `backend::Cpu`. It is part
// of the CPU backend (link `kvpolicy::cpu` or `kvpolicy::kvpolicy`), so no core
// header names a backend; a core-only user (backend::Scalar) includes the
// headers it needs one by one. The readers under kvpolicy/io/ need
// nlohmann-json and are included separately.
#pragma once

#include "kvpolicy/core/any_tensor_view.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/core/keep_set.hpp"
#include "kvpolicy/core/kv_source.hpp"
#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/core/version.hpp"
#include "kvpolicy/core/workspace.hpp"

#include "kvpolicy/ops/batched.hpp"
#include "kvpolicy/ops/contract.hpp"
#include "kvpolicy/ops/merge_scalar.hpp"
#include "kvpolicy/ops/scalar.hpp"

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/budget/pyramid.hpp"
#include "kvpolicy/policy/budget/schedule.hpp"
#include "kvpolicy/policy/compose.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/lifecycle.hpp"
#include "kvpolicy/policy/lookahead.hpp"
#include "kvpolicy/policy/pipeline.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/knorm.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/mixed_precision.hpp"
#include "kvpolicy/policy/quantization/quant_spec.hpp"
#include "kvpolicy/policy/quantization/quantized_keys.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/quant/fp8.hpp"
#include "kvpolicy/quant/ggml.hpp"

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/apply/compact_ragged.hpp"
#include "kvpolicy/apply/merge.hpp"

#include "kvpolicy/easy.hpp"
#include "kvpolicy/registry.hpp"
#include "kvpolicy/util/thread_pool.hpp"

#include "kvpolicy/backends/cpu.hpp"

// Every policy models its family concepts on the CPU backend too.
static_assert(kvpolicy::EvictionPolicy<kvpolicy::SnapKV, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::EvictionPolicy<kvpolicy::LAQ, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::EvictionPolicy<kvpolicy::StreamingLLM, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::EvictionPolicy<kvpolicy::ObservedAttention, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::EvictionPolicy<kvpolicy::TOVA, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::EvictionPolicy<kvpolicy::PyramidKV, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(
    kvpolicy::EvictionPolicy<kvpolicy::AdaKV<kvpolicy::SnapKV>, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(
    kvpolicy::EvictionPolicy<kvpolicy::ExpectedAttention, kvpolicy::ExpectedAttentionInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::OnlineEvictionPolicy<kvpolicy::H2O, kvpolicy::ScoreInput<float, kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::SelectionPolicy<kvpolicy::Quest, float, kvpolicy::half, kvpolicy::half, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::PrefetchPolicy<kvpolicy::QuestLookahead<float>, float, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::PrefetchPolicy<kvpolicy::InfiniGen, float, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::PrefetchPolicy<kvpolicy::SpeCache, float, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::PrefetchPolicy<kvpolicy::ShadowKV, float, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::KvpressMerging, kvpolicy::MergeInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::KvpressCAM, kvpolicy::MergeInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::CaM, kvpolicy::MergeInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::D2O, kvpolicy::D2OInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::LookMPivot, kvpolicy::MergeInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
static_assert(kvpolicy::MergePolicy<kvpolicy::NearestKeptMerge, kvpolicy::NearestKeptInput<kvpolicy::half>, kvpolicy::backend::Cpu>);
