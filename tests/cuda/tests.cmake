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
