# The common interface: concepts per (policy, backend), requirements, the
# vocabulary, batched ops, the convenience layer, the registry, the lifecycle,
# and the bad-input tables of the public entry points.
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_interface ${CMAKE_CURRENT_LIST_DIR}/test_interface.cpp ${CMAKE_CURRENT_LIST_DIR}/test_registry.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_bad_input.cpp)
endif()
