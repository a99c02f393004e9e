# kvpolicy-compare: the policy comparison (the README's main job).
# Included from examples/compare.cmake; needs the CPU backend and nlohmann-json
# (for kvpolicy/io/, which reads trace files).
find_package(nlohmann_json 3 QUIET)
if(TARGET kvpolicy_cpu AND TARGET nlohmann_json::nlohmann_json)
  add_executable(kvpolicy-compare ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  target_include_directories(kvpolicy-compare PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvpolicy-compare PRIVATE kvpolicy::kvpolicy nlohmann_json::nlohmann_json)
  kvp_set_warnings(kvpolicy-compare)
  # The end-to-end workload runs the engine loop (examples/engine/, Eigen 3.4) on the committed model.
  find_package(Eigen3 3.4 QUIET NO_MODULE)
  if(TARGET Eigen3::Eigen)
    target_include_directories(kvpolicy-compare PRIVATE ${PROJECT_SOURCE_DIR}/examples)
    target_link_libraries(kvpolicy-compare PRIVATE Eigen3::Eigen)
    target_compile_definitions(kvpolicy-compare PRIVATE KVP_COMPARE_WITH_ENGINE=1
      KVP_COMPARE_MODEL_DIR="${PROJECT_SOURCE_DIR}/models/kvp-tiny"
      KVP_COMPARE_TASK_SET="${PROJECT_SOURCE_DIR}/tests/data/engine/eval_set.json")
  else()
    message(STATUS "kvpolicy: kvpolicy-compare without end-to-end tasks (needs Eigen 3.4)")
  endif()
else()
  message(STATUS "kvpolicy: kvpolicy-compare skipped (needs the CPU backend and nlohmann-json)")
endif()
