# util: the bundled ThreadPool (several calling threads, nesting, exceptions).
find_package(Threads REQUIRED)
kvp_add_test(test_util ${CMAKE_CURRENT_LIST_DIR}/test_thread_pool.cpp)
target_link_libraries(test_util PRIVATE Threads::Threads)
