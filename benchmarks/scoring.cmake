# Scoring policies (SnapKV-family selection, Ada-KV, PyramidKV, Expected
# Attention) at 32K tokens, and the kvpress speed-comparison driver used by
# tools/compare_kvpress_speed.py.
if(NOT TARGET kvpolicy_cpu)
  message(STATUS "kvpolicy: CPU backend off, kvp_speed_driver and bench_scoring not built")
  return()
endif()
add_executable(kvp_speed_driver ${PROJECT_SOURCE_DIR}/tools/kvp_speed_driver.cpp)
target_link_libraries(kvp_speed_driver PRIVATE kvpolicy::kvpolicy)
target_compile_features(kvp_speed_driver PRIVATE cxx_std_20)
kvp_set_warnings(kvp_speed_driver)

find_package(benchmark QUIET)
if(TARGET benchmark::benchmark)
  add_executable(bench_scoring ${CMAKE_CURRENT_LIST_DIR}/bench_scoring.cpp)
  target_link_libraries(bench_scoring PRIVATE kvpolicy::kvpolicy benchmark::benchmark)
  target_include_directories(bench_scoring PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_compile_features(bench_scoring PRIVATE cxx_std_20)
  kvp_set_warnings(bench_scoring)
else()
  message(STATUS "kvpolicy: Google Benchmark not found, bench_scoring not built")
endif()
