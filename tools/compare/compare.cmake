# kvpolicy-compare: the policy comparison (the README's main job).
# Included from examples/compare.cmake; needs the CPU backend and nlohmann-json
# (for kvpolicy/io/, which reads trace files).
find_package(nlohmann_json 3 QUIET)
if(TARGET kvpolicy_cpu AND TARGET nlohmann_json::nlohmann_json)
  add_executable(kvpolicy-compare ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  target_include_directories(kvpolicy-compare PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvpolicy-compare PRIVATE kvpolicy::kvpolicy nlohmann_json::nlohmann_json)
  kvp_set_warnings(kvpolicy-compare)
  # The end-to-end workload runs the engine loop on the committed model: kvp_engine_lib
  # (examples/engine/CMakeLists.txt), added by examples/CMakeLists.txt before this file.
  if(TARGET kvp_engine_lib)
    target_link_libraries(kvpolicy-compare PRIVATE kvp_engine_lib)
    target_compile_definitions(kvpolicy-compare PRIVATE KVP_COMPARE_WITH_ENGINE=1
      KVP_COMPARE_MODEL_DIR="${PROJECT_SOURCE_DIR}/models/kvp-tiny"
      KVP_COMPARE_TASK_SET="${PROJECT_SOURCE_DIR}/tests/data/engine/eval_set.json"
      KVP_COMPARE_REAL_TASK_SET="${PROJECT_SOURCE_DIR}/tests/data/engine/smollm2_tasks.json")
  else()
    message(STATUS "kvpolicy: kvpolicy-compare without end-to-end tasks (needs kvp_engine_lib: nlohmann-json)")
  endif()
else()
  message(STATUS "kvpolicy: kvpolicy-compare skipped (needs the CPU backend and nlohmann-json)")
endif()
