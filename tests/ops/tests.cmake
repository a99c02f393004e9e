# ops: the scalar reference ops (the oracle every backend is tested against).
kvp_add_test(test_ops ${CMAKE_CURRENT_LIST_DIR}/test_ops_scalar.cpp)
