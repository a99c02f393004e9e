# kvpolicy::cuda benchmarks: only when the CUDA backend and Google Benchmark are both available.
if(TARGET kvpolicy_cuda)
  find_package(benchmark QUIET)
  if(TARGET benchmark::benchmark)
    add_executable(bench_cuda ${CMAKE_CURRENT_LIST_DIR}/bench_cuda.cpp)
    target_link_libraries(bench_cuda PRIVATE kvpolicy::cuda benchmark::benchmark)  # CUDA::cudart via kvpolicy::cuda
    target_compile_features(bench_cuda PRIVATE cxx_std_20)
    kvp_set_warnings(bench_cuda)
  else()
    message(STATUS "kvpolicy: Google Benchmark not found, bench_cuda not built")
  endif()
endif()
