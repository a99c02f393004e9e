// SPDX-License-Identifier: Apache-2.0
// Page-op kernels for the sse2 level (flags and KVP_CPU_TU_ISA come from CMake).
#include "paged_ops_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
namespace pk = KVP_CPU_ISA_NS::paged;
KVP_CPU_DEFINE_KERNELS(PagedKernels, paged_kernels, &pk::fold<float, float>, &pk::fold<half, half>, &pk::fold<half, float>,
                       &pk::fold<bfloat16, bfloat16>, &pk::fold<bfloat16, float>, &pk::bounds<float>, &pk::bounds<half>,
                       &pk::bounds<bfloat16>, &pk::attention<float>, &pk::attention<half>, &pk::attention<bfloat16>)
}  // namespace cpu_detail
KVP_NAMESPACE_END
