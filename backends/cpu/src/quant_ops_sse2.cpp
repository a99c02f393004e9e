// SPDX-License-Identifier: Apache-2.0
// Quantization kernels for the sse2 level (flags, -ffp-contract=off and KVP_CPU_TU_ISA come from CMake).
#include "quant_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
KVP_CPU_DEFINE_KERNELS(QuantKernels, quant_kernels, &KVP_CPU_ISA_NS::quantize_f32, &KVP_CPU_ISA_NS::quantize_f16,
                       &KVP_CPU_ISA_NS::dequantize_f32, &KVP_CPU_ISA_NS::dequantize_f16, &KVP_CPU_ISA_NS::first_nonfinite_f32,
                       &KVP_CPU_ISA_NS::first_nonfinite_f16)
}  // namespace cpu_detail
KVP_NAMESPACE_END
