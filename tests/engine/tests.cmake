# engine: the minimal engine loop (examples/engine/) on the committed kvp-tiny model against the PyTorch fixtures
# (tests/data/engine/), task accuracy and policy behaviour end to end. Needs Eigen 3.4 and nlohmann-json.
find_package(Eigen3 3.4 QUIET NO_MODULE)
find_package(nlohmann_json 3 QUIET)
if(TARGET kvpolicy_cpu AND TARGET Eigen3::Eigen AND TARGET nlohmann_json::nlohmann_json)
  kvp_add_test(test_engine
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_logits.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_tasks.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_task_workload.cpp)
  target_include_directories(test_engine PRIVATE ${PROJECT_SOURCE_DIR}/examples ${CMAKE_CURRENT_LIST_DIR} ${PROJECT_SOURCE_DIR}/tools/compare)
  target_link_libraries(test_engine PRIVATE Eigen3::Eigen nlohmann_json::nlohmann_json)
  target_compile_definitions(test_engine PRIVATE KVP_ENGINE_DEFAULT_MODEL_DIR="${PROJECT_SOURCE_DIR}/models/kvp-tiny")
else()
  message(STATUS "kvpolicy: engine tests skipped (need the CPU backend, Eigen 3.4 and nlohmann-json)")
endif()
