# CPU backend tests: every op of backend::Cpu against the scalar reference, on
# every ISA level this machine has. Sanitizer builds scale the largest shapes
# down automatically (see cpu_test_util.hpp).
kvp_add_test(test_cpu
  ${CMAKE_CURRENT_LIST_DIR}/test_window_scores.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_topk.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_kth_key.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_pool1d.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_reduce.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_isa.cpp)
# test_kth_key.cpp reaches the top-k's internal rank search through the CPU backend's kernel table.
target_include_directories(test_cpu PRIVATE ${PROJECT_SOURCE_DIR}/backends/cpu/src)

# The environment override is read at first use, so it needs its own process.
add_test(NAME "test_cpu: KVP_CPU_ISA=sse2 at first use" COMMAND test_cpu "Cpu ISA: the level in use honours KVP_CPU_ISA at first use")
set_tests_properties("test_cpu: KVP_CPU_ISA=sse2 at first use" PROPERTIES ENVIRONMENT "KVP_CPU_ISA=sse2")
