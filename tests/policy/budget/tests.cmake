# Budgets: the Budget vocabulary, layer schedules, per-head allocation.
kvp_add_test(test_budget ${CMAKE_CURRENT_LIST_DIR}/test_budget.cpp)
