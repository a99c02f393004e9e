kvp_add_test(test_core
  ${CMAKE_CURRENT_LIST_DIR}/test_dtype.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_views.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_ops_scalar.cpp)
