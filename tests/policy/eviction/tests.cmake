# Eviction policies: StreamingLLM, SnapKV, H2O, TOVA, ObservedAttention, Ada-KV,
# PyramidKV, Expected Attention, Knorm, LAQ and lookahead queries (unit, golden vectors, ISA levels).
kvp_add_test(test_eviction
  ${CMAKE_CURRENT_LIST_DIR}/test_snapkv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_streaming_llm.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_h2o.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_tova.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_observed_attention.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_isa_levels.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_adakv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_adakv_keep.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_device_paths.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_pyramidkv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_expected_attention.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_laq.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_ties.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_knorm.cpp)

# Cross-validation against the reference fixtures (kvpress and the original
# repositories; needs the fixture reader and nlohmann-json).
find_package(nlohmann_json 3 QUIET)
if(TARGET nlohmann_json::nlohmann_json AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/../../reference/fixture_reader.hpp")
  kvp_add_test(test_eviction_fixtures
    ${CMAKE_CURRENT_LIST_DIR}/test_fixtures_online.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_fixtures_scoring.cpp)
  target_link_libraries(test_eviction_fixtures PRIVATE nlohmann_json::nlohmann_json)
endif()
