// Must NOT compile: writing through a read-only view, or turning a const view
// into a mutable one. Built by ctest with WILL_FAIL (see tests.cmake).
#include "kvpolicy/core/tensor_view.hpp"

int main() {
  float buf[4] = {};
  const kvpolicy::TensorView<const float, 1> v = kvpolicy::TensorView<const float, 1>::contiguous(buf, {4});
#if KVP_FAILTEST_CASE == 1
  v(0) = 1.0f;
#else
  kvpolicy::TensorView<float, 1> m = v;
  (void)m;
#endif
  return 0;
}
