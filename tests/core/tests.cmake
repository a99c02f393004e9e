kvp_add_test(test_core
  ${CMAKE_CURRENT_LIST_DIR}/test_dtype.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_views.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_checked.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_page_tables.cpp)

# Compile-fail tests: const-correctness of views (the build itself must fail).
foreach(case 1 2)
  add_executable(failtest_const_view_${case} EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/failtest_const_view.cpp)
  target_link_libraries(failtest_const_view_${case} PRIVATE kvpolicy::core)
  target_compile_definitions(failtest_const_view_${case} PRIVATE KVP_FAILTEST_CASE=${case})
  add_test(NAME "failtest: const view case ${case} does not compile"
           COMMAND ${CMAKE_COMMAND} --build ${CMAKE_BINARY_DIR} --target failtest_const_view_${case})
  set_tests_properties("failtest: const view case ${case} does not compile" PROPERTIES WILL_FAIL TRUE)
endforeach()
