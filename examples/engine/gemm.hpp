// SPDX-License-Identifier: Apache-2.0
// The engine's fp32 matrix products (private to kvp_engine_lib and its tests):
// row-major operands with leading dimensions, no Eigen, no BLAS.
//
//   gemm_nt  c(m, n) (+)= a(m, k) * b(n, k)^T   both operands contiguous along k: a Linear layer
//                                                (b = W, out x in), Q K^T
//   gemm_nn  c(m, n) (+)= a(m, k) * b(k, n)     b contiguous along n: P V
//
// Kernels (gemm_kernels_impl.hpp, written once, compiled per instruction-set
// level):
//  * gemm_nt: register tiles of up to 6 rows of a x 4 rows of b (AVX-512;
//    3 x 4 for AVX2, 2 x 4 for SSE2), one vector accumulator per (row of a,
//    row of b) pair running along k, and one horizontal reduction per tile at
//    the end (the 4 sums of a row of the tile leave as one 128-bit vector).
//    The k tail is read with masked loads (partial loads for SSE2), so nothing
//    past a row is touched; a tile with fewer than 4 rows of b repeats its
//    last row and drops those sums. Rows of b are taken in blocks of ~256 KiB
//    (L2), each reused by every row of a; k beyond 768 is split into equal
//    passes that add into c, so that a tile's rows of a and b stay in L1.
//    With m = 1 (decode) this is a GEMV that reads each weight once,
//    contiguously: ~38 GB/s on the 49152 x 576 lm_head here, the machine's
//    single-core read bandwidth.
//  * gemm_nn: tiles of 6 rows of a x 64 columns of b (AVX-512; 6 x 16 for AVX2,
//    4 x 8 for SSE2): for each k, a[i, k] broadcast times the vectors of row k
//    of b; the column tail uses masked loads and stores.
//
// Dispatch: each call runs the kernels of the instruction-set level the
// kvpolicy CPU backend uses (`kvpolicy::backend::Cpu::isa()`: the best level
// of the machine, lowered by KVP_CPU_ISA=sse2|avx2|avx512; tests switch it
// with `Cpu::set_isa`). The library is built without -march: gemm_sse2.cpp,
// gemm_avx2.cpp and gemm_avx512.cpp get their level's flags from
// examples/engine/CMakeLists.txt, as the backend's per-ISA units do.
//
// Numerics contract: c[i, j] is the fp32 sum of the k products a[i, p] *
// b[p, j] (b[j, p] for gemm_nt), plus the old c[i, j] when accumulating, in
// some order, with fused multiply-adds where the level has them (AVX2,
// AVX-512). So results differ from another order (Eigen, PyTorch, a scalar
// loop) by rounding only, within the bound of any summation order:
// |c - exact| <= gamma(k + 1) * (|c_old| + sum_p |a||b|), gamma(j) = j u / (1 - j u),
// u = 2^-24. Observed errors are far smaller (gemm_nt adds k / width terms per
// lane, then a tree of the lanes): tests/engine/test_gemm.cpp asserts 1e-5 of
// that sum and sees < 3e-7. The order is fixed for a given shape and level, so
// runs are deterministic, but it depends on the level: logits may differ in
// their last bits between machines or KVP_CPU_ISA settings.
//
// Shapes: any m, n, k >= 0. k = 0 writes zeros (or leaves c unchanged when
// accumulating); m = 0 or n = 0 touches nothing. Leading dimensions are in
// floats and at least the row length (lda >= k; ldb >= k for gemm_nt, >= n
// for gemm_nn; ldc >= n); c must not overlap a or b. No alignment required.
#pragma once

#include <cstdint>

namespace kvp_engine {

/// c(m, n) = a(m, k) * b(n, k)^T, or c += ... when `accumulate`.
void gemm_nt(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate = false) noexcept;

/// c(m, n) = a(m, k) * b(k, n), or c += ... when `accumulate`.
void gemm_nn(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate = false) noexcept;

/// Prefill's causal attention softmax on one block of scores, in place: row i
/// (of `rows`, `lds` floats apart) has `cols` scores of which the first
/// `first + i` are visible; those become softmax(scale * score), the rest 0.
/// Requires first >= 1, first + rows - 1 <= cols, scale > 0; same dispatch as
/// the products. Numerics: exp(x) by range reduction and a degree-7
/// polynomial, never more than 1 ulp from the correctly rounded value on
/// [-104, 0] (checked on every float there at each level: 99.1-99.5% exact;
/// below -104 exp rounds to 0 in float), so a probability differs from a
/// scalar std::exp softmax by about an ulp, plus the order of its denominator's
/// sum (vector lanes, then a tree).
void softmax_causal(float* s, std::int64_t lds, std::int64_t rows, std::int64_t cols, std::int64_t first, float scale) noexcept;

}  // namespace kvp_engine
