// SPDX-License-Identifier: Apache-2.0
// Quantization kernels for the avx2 level (flags, -ffp-contract=off and KVP_CPU_TU_ISA come from CMake).
#include "quant_kernels_impl.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
KVP_CPU_DEFINE_KERNELS(QuantKernels, quant_kernels, &KVP_CPU_ISA_NS::quantize_f32, &KVP_CPU_ISA_NS::quantize_f16,
                       &KVP_CPU_ISA_NS::dequantize_f32, &KVP_CPU_ISA_NS::dequantize_f16, &KVP_CPU_ISA_NS::first_nonfinite_f32,
                       &KVP_CPU_ISA_NS::first_nonfinite_f16, &KVP_CPU_ISA_NS::rotate_in_f32, &KVP_CPU_ISA_NS::rotate_in_f16,
                       &KVP_CPU_ISA_NS::rotate_out_f32, &KVP_CPU_ISA_NS::rotate_out_f16, &KVP_CPU_ISA_NS::int4_quantize,
                       &KVP_CPU_ISA_NS::int4_dequantize_f32, &KVP_CPU_ISA_NS::int4_dequantize_f16, &KVP_CPU_ISA_NS::fp8_quantize_f32,
                       &KVP_CPU_ISA_NS::fp8_quantize_f16, &KVP_CPU_ISA_NS::fp8_dequantize_f32, &KVP_CPU_ISA_NS::fp8_dequantize_f16,
                       &KVP_CPU_ISA_NS::first_not_below, &KVP_CPU_ISA_NS::kivi_r16_f32, &KVP_CPU_ISA_NS::kivi_r16_f16,
                       &KVP_CPU_ISA_NS::kivi_quantize_keys, &KVP_CPU_ISA_NS::kivi_dequantize_keys, &KVP_CPU_ISA_NS::kivi_quantize_values,
                       &KVP_CPU_ISA_NS::kivi_dequantize_values)
}  // namespace cpu_detail
KVP_NAMESPACE_END
