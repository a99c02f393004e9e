# io: safetensors reader/writer and the trace format (needs nlohmann-json, as does kvpolicy/io/).
find_package(nlohmann_json 3 REQUIRED)
kvp_add_test(test_io
  ${CMAKE_CURRENT_LIST_DIR}/test_safetensors.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_trace.cpp)
target_link_libraries(test_io PRIVATE nlohmann_json::nlohmann_json)
