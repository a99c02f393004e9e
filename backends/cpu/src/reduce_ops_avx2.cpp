// SPDX-License-Identifier: Apache-2.0
// Row-reduction kernels for the avx2 level (flags and KVP_CPU_TU_ISA come from CMake).
#include "reduce_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
KVP_CPU_DEFINE_KERNELS(ReduceKernels, reduce_kernels, &KVP_CPU_ISA_NS::argmin_or_nan, &KVP_CPU_ISA_NS::has_nan,
                       &KVP_CPU_ISA_NS::mean_rows_f32, &KVP_CPU_ISA_NS::widen_f16, &KVP_CPU_ISA_NS::row_dots_f32,
                       &KVP_CPU_ISA_NS::expected_logits_block, &KVP_CPU_ISA_NS::outer_upper_accumulate,
                       &KVP_CPU_ISA_NS::outer_upper_add_f64, &KVP_CPU_ISA_NS::accumulate_rows_f64, &KVP_CPU_ISA_NS::centre_rows,
                       &KVP_CPU_ISA_NS::add_upper_f64, &KVP_CPU_ISA_NS::neg_norms16, KVP_CPU_ISA_NS::kRL)
}  // namespace cpu_detail
KVP_NAMESPACE_END
