// SPDX-License-Identifier: Apache-2.0
// `backend::Cpu`: the CPU SIMD backend (kvpolicy::cpu). Policies instantiated
// with it call the vectorised ops of `CpuScoreOps`, `CpuPageOps` and
// `CpuReduceOps` and fall
// back to the scalar reference, by inheritance, for every op they do not
// specialise.
//
// Instruction set: chosen once, at first use, as the best level this machine
// and OS support (cpuid + xgetbv), unless the environment variable
// KVP_CPU_ISA=sse2|avx2|avx512 asks for a lower one. `set_isa` changes it at
// run time (tests and benchmarks use it to compare levels).
#pragma once

#include "kvpolicy/backends/cpu_isa.hpp"
#include "kvpolicy/backends/cpu_page_ops.hpp"
#include "kvpolicy/backends/cpu_quant_ops.hpp"
#include "kvpolicy/backends/cpu_reduce_ops.hpp"
#include "kvpolicy/backends/cpu_score_ops.hpp"
#include "kvpolicy/ops/contract.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

// Score ops, page ops and row reductions, one base per op family (each falls back to its scalar family).
struct Cpu : CpuScoreOps, CpuPageOps, CpuReduceOps, CpuQuantOps {
  /// Name of the instruction set in use ("sse2", "avx2", "avx512").
  static const char* isa_name() noexcept;

  /// The instruction set in use.
  static CpuIsa isa() noexcept;

  /// The best instruction set this machine and OS support.
  static CpuIsa best_isa() noexcept;

  /// Use `isa` from now on, process-wide; false (and no change) when the
  /// machine lacks it. Thread-safe, but calls running concurrently on other
  /// threads may still use the previous level: meant for tests and benchmarks.
  static bool set_isa(CpuIsa isa) noexcept;

  /// bf16 dot form of `window_scores` on bf16 keys (SnapKV, Ada-KV, PyramidKV, TOVA, ObservedAttention, H2O
  /// from queries), off by default. On: at the AVX-512 level of a CPU with AVX512_BF16 (`has_bf16_dot()`),
  /// with an even head_dim, the logits come from vdpbf16ps: the queries are rounded to bf16 (nearest, ties to
  /// even), the bf16 products are exact, and they are added in fp32 a channel pair at a time; the instruction
  /// treats denormal inputs as zero and flushes a denormal result. The one approximation is the query
  /// rounding: each logit's error is at most 2^-8 x sum_c |q_c k_c| (x scale), so scores move by about that
  /// relative to the exact form and near-tied tokens may swap; the softmax, pooling and top-k that follow are
  /// unchanged. About 1.5x faster than the fp32 form on the same keys (bench_ops window_scores .../bf16_dot).
  /// Other key types, odd head_dim and other levels always take the fp32 form. `set_bf16_dot(true)` returns
  /// false (no change) where the CPU lacks AVX512_BF16; the environment variable KVP_CPU_BF16_DOT=1 turns
  /// the form on at first use. Process-wide, like `set_isa`.
  static bool has_bf16_dot() noexcept;
  static bool bf16_dot() noexcept;
  static bool set_bf16_dot(bool on) noexcept;

  /// Streaming (non-temporal) stores for the decoders' output, off by default: `ggml_dequantize_row` (so
  /// GgmlQuant's dequantize without rotation), `int4_dequantize_rows` (Int4Quant without rotation) and
  /// `kivi_dequantize_value_rows` (KiviQuant values). A normal store first reads the line it writes into the
  /// cache and later writes it back; a streaming store writes it to memory once and leaves nothing in the
  /// cache. On: a call whose output is at least 64 KiB (rows contiguous, for the row decoders) decodes 4096
  /// values at a time into a buffer on the stack, prefetches the next piece's codes, streams the piece to the
  /// output (normal stores for a partial line at either end), and fences at the end; shorter outputs keep
  /// normal stores. The values written are the same either way. Turn it on for bulk decodes whose output is
  /// not read again soon (a layer decoded for a host-side pass or a copy); leave it off when the next kernel
  /// reads the output, which would then come from memory. bench_quant dequantize/<format>/streaming, from
  /// memory on the machine of the figures (one layer, 8 x 16384 x 128 fp16 out): q8_0 4.57 -> 3.60 ms, q4_0
  /// 4.23 -> 3.25 ms, int4_token 4.23 -> 2.94 ms, kivi_v2 4.14 -> 3.64 ms. Where the same form measured slower
  /// it is not used: the fp8 decoders (4.80 -> 5.17 ms; measured again on an AVX2 machine after their decode got
  /// cheaper: 4.5-5.9 ms either way, no gain within its noise) and
  /// the quantizers (q8_0 4.53 -> 5.49 ms; their codes are a third of their input or less). The environment
  /// variable KVP_CPU_STREAMING_STORES=1 turns it on at first use. Process-wide, like `set_isa`.
  static bool streaming_stores() noexcept;
  static void set_streaming_stores(bool on) noexcept;

  /// Times a vectorised op was handed a workspace smaller than its own
  /// `*_workspace()` and ran the scalar reference instead (process-wide,
  /// monotone). Policies never cause it: they size and check the workspace
  /// for the backend of their context and reject a short one with
  /// kWorkspaceTooSmall. Direct op callers can watch it (the benchmarks
  /// report it; tests assert it stays 0).
  static std::uint64_t reference_fallbacks() noexcept;
};

static_assert(HostBackend<Cpu>, "backend::Cpu must model the whole ops contract (ops/contract.hpp)");

}  // namespace backend
KVP_NAMESPACE_END
