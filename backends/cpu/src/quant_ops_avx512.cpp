// SPDX-License-Identifier: Apache-2.0
// Quantization kernels for the avx512 level (flags, -ffp-contract=off and KVP_CPU_TU_ISA come from CMake).
#include "quant_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
KVP_CPU_DEFINE_KERNELS(QuantKernels, quant_kernels, KVP_QUANT_KERNEL_ENTRIES)
}  // namespace cpu_detail
KVP_NAMESPACE_END
