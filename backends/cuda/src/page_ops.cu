// SPDX-License-Identifier: Apache-2.0
// The PageOps family of `backend::Cuda` (placeholder translation unit: the
// kernels are being written; nothing here is declared done).
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"
