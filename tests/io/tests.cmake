# io: safetensors reader/writer, the GGUF reader and the trace format (needs nlohmann-json, as does kvpolicy/io/).
find_package(nlohmann_json 3 REQUIRED)
kvp_add_test(test_io
  ${CMAKE_CURRENT_LIST_DIR}/test_safetensors.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_trace.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_gguf.cpp)
target_link_libraries(test_io PRIVATE nlohmann_json::nlohmann_json)

# Sanity of the policy comparison (tools/compare, header-only parts).
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_compare ${CMAKE_CURRENT_LIST_DIR}/test_compare.cpp)
  target_include_directories(test_compare PRIVATE ${PROJECT_SOURCE_DIR}/tools/compare)
  target_link_libraries(test_compare PRIVATE nlohmann_json::nlohmann_json)
endif()
