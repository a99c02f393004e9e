// SPDX-License-Identifier: Apache-2.0
// The engine's gemm kernels for the sse2 level (flags and KVP_CPU_TU_ISA come from CMakeLists.txt).
#include "gemm_kernels_impl.hpp"

KVP_GEMM_DEFINE_KERNELS()
