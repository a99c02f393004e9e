// SPDX-License-Identifier: Apache-2.0
#pragma once

/// kvpolicy version. CMake parses these three lines; keep the format.
#define KVP_VERSION_MAJOR 0
#define KVP_VERSION_MINOR 1
#define KVP_VERSION_PATCH 0

/// All public symbols live in `kvpolicy::v0` (an inline namespace), so two
/// incompatible releases linked into one process never share mangled names.
#define KVP_NAMESPACE_BEGIN \
  namespace kvpolicy {      \
  inline namespace v0 {
#define KVP_NAMESPACE_END \
  }                       \
  }
