// SPDX-License-Identifier: Apache-2.0
// Compiler configuration shared by host and device code.
//
// `KVP_HOST_DEVICE` marks the small core helpers (row addressing, the top-k
// order key) that CUDA kernels call directly, so the device backend reuses
// them instead of keeping twins: `__host__ __device__` under nvcc, nothing
// otherwise.
#pragma once

#include "kvpolicy/core/version.hpp"

#if defined(__CUDACC__)
#define KVP_HOST_DEVICE __host__ __device__
#else
#define KVP_HOST_DEVICE
#endif
