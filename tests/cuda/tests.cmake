# kvpolicy::cuda tests (only when the CUDA backend is built).
#  - test_cuda_args: host-only (plain C++): argument validation, the op-family concepts, every device-capable
#    policy's host checks; runs without a GPU.
#  - the device tests (own main, Cuda vs Scalar on a GPU; exit 77 = "skipped" without a device):
#    test_cuda_ops       window scores and top-k
#    test_cuda_policies  the contract ops and every policy on backend::Cuda, CUDA-graph captures
#    test_cuda_page_ops  the PageOps family (Quest's metadata fold, bounds, decode attention over pages)
if(TARGET kvpolicy_cuda)
  add_executable(test_cuda_args ${CMAKE_CURRENT_LIST_DIR}/test_cuda_args.cpp)
  target_link_libraries(test_cuda_args PRIVATE kvp_catch_main kvpolicy::cuda)
  kvp_set_warnings(test_cuda_args)
  catch_discover_tests(test_cuda_args TEST_PREFIX "test_cuda_args: " DISCOVERY_TIMEOUT 60)

  foreach(name test_cuda_ops test_cuda_policies test_cuda_page_ops)
    add_executable(${name} ${CMAKE_CURRENT_LIST_DIR}/${name}.cpp)
    target_link_libraries(${name} PRIVATE Catch2::Catch2 kvpolicy::kvpolicy kvpolicy::cuda)  # CUDA::cudart comes with it (PUBLIC)
    target_compile_features(${name} PRIVATE cxx_std_20)
    kvp_set_warnings(${name})
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77 LABELS cuda TIMEOUT 600)
  endforeach()
endif()
