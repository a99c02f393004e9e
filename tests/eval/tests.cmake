# eval: paged attention helpers and page-selection metrics (eval/page_metrics.hpp).
kvp_add_test(test_eval ${CMAKE_CURRENT_LIST_DIR}/test_page_metrics.cpp)
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_eval_cpu ${CMAKE_CURRENT_LIST_DIR}/test_page_metrics_cpu.cpp)
endif()
