// SPDX-License-Identifier: Apache-2.0
// Eigen views of the engine's row-major fp32 buffers. Private to the sources
// of kvp_engine_lib (model.cpp, engine.cpp): the public engine headers do not
// include Eigen, and the library's users are not given its include path.
#pragma once

#include <Eigen/Core>

namespace kvp_engine {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;
using StridedConstMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
using StridedMap = Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>>;

}  // namespace kvp_engine
