# kvpolicy::cuda tests (only when the CUDA backend is built).
#  - test_cuda_args: host-only (plain C++), argument validation; runs without a GPU.
#  - test_cuda_ops:  Cuda vs Scalar on a device; exits 77 ("skipped") when no device is present.
if(TARGET kvpolicy_cuda)
  add_executable(test_cuda_args ${CMAKE_CURRENT_LIST_DIR}/test_cuda_args.cpp)
  target_link_libraries(test_cuda_args PRIVATE kvp_catch_main kvpolicy::cuda)
  kvp_set_warnings(test_cuda_args)
  catch_discover_tests(test_cuda_args TEST_PREFIX "test_cuda_args: " DISCOVERY_TIMEOUT 60)

  add_executable(test_cuda_ops ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.cpp)
  target_link_libraries(test_cuda_ops PRIVATE Catch2::Catch2 kvpolicy::cuda)  # CUDA::cudart comes with it (PUBLIC)
  target_compile_features(test_cuda_ops PRIVATE cxx_std_20)
  kvp_set_warnings(test_cuda_ops)
  add_test(NAME test_cuda_ops COMMAND test_cuda_ops)
  set_tests_properties(test_cuda_ops PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda TIMEOUT 600)
endif()

# Policies on backend::Cuda vs backend::Scalar (SnapKV, StreamingLLM, a graph capture); exits 77 without a device.
if(TARGET kvpolicy_cuda)
  add_executable(test_cuda_policies ${CMAKE_CURRENT_LIST_DIR}/test_cuda_policies.cpp)
  target_link_libraries(test_cuda_policies PRIVATE Catch2::Catch2 kvpolicy::kvpolicy kvpolicy::cuda)
  target_compile_features(test_cuda_policies PRIVATE cxx_std_20)
  kvp_set_warnings(test_cuda_policies)
  add_test(NAME test_cuda_policies COMMAND test_cuda_policies)
  set_tests_properties(test_cuda_policies PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda TIMEOUT 600)
endif()

# The PageOps family (Quest's metadata fold, bounds, decode attention over pages) on backend::Cuda vs
# backend::Scalar; exits 77 without a device.
if(TARGET kvpolicy_cuda AND EXISTS ${CMAKE_CURRENT_LIST_DIR}/test_cuda_page_ops.cpp)
  add_executable(test_cuda_page_ops ${CMAKE_CURRENT_LIST_DIR}/test_cuda_page_ops.cpp)
  target_link_libraries(test_cuda_page_ops PRIVATE Catch2::Catch2 kvpolicy::kvpolicy kvpolicy::cuda)
  target_compile_features(test_cuda_page_ops PRIVATE cxx_std_20)
  kvp_set_warnings(test_cuda_page_ops)
  add_test(NAME test_cuda_page_ops COMMAND test_cuda_page_ops)
  set_tests_properties(test_cuda_page_ops PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda TIMEOUT 600)
endif()
