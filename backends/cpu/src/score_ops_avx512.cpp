// SPDX-License-Identifier: Apache-2.0
// Score-op kernels for the avx512 level (flags and KVP_CPU_TU_ISA come from CMake).
#include "score_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
KVP_CPU_DEFINE_KERNELS(ScoreKernels, score_kernels, &KVP_CPU_ISA_NS::window_scores<float>, &KVP_CPU_ISA_NS::window_scores<half>,
                       &KVP_CPU_ISA_NS::window_scores<bfloat16>, &KVP_CPU_ISA_NS::window_scores<bfloat16, true>,
                       &KVP_CPU_ISA_NS::pool1d_full, &KVP_CPU_ISA_NS::collect_at_least, &KVP_CPU_ISA_NS::gather_keys,
                       &KVP_CPU_ISA_NS::keep_in_key_range, &KVP_CPU_ISA_NS::keep_at_least, &KVP_CPU_ISA_NS::load_keys,
                       &KVP_CPU_ISA_NS::block_max_keys, &KVP_CPU_ISA_NS::collect_in_blocks, &KVP_CPU_ISA_NS::count_keys_at_least,
                       &KVP_CPU_ISA_NS::kth_largest_key)
}  // namespace cpu_detail
KVP_NAMESPACE_END
