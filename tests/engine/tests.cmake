# engine: the minimal engine loop (examples/engine/, linked as kvp_engine_lib) on the committed kvp-tiny model
# against the PyTorch fixtures (tests/data/engine/), task accuracy and policy behaviour end to end, and the
# engine's matrix products (test_gemm.cpp). Needs the CPU backend and nlohmann-json (for kvp_engine_lib).
find_package(nlohmann_json 3 QUIET)
include(${PROJECT_SOURCE_DIR}/examples/engine/engine_lib.cmake)
if(TARGET kvp_engine_lib)
  kvp_add_test(test_engine
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_logits.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_gemm.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_tasks.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_task_workload.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_laq.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_smollm2.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_merging.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_engine_kivi.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_smollm2_kvpress.cpp
    ${CMAKE_CURRENT_LIST_DIR}/test_trace_export.cpp)
  target_include_directories(test_engine PRIVATE ${CMAKE_CURRENT_LIST_DIR} ${PROJECT_SOURCE_DIR}/tools/compare)
  target_link_libraries(test_engine PRIVATE kvp_engine_lib nlohmann_json::nlohmann_json)
  target_compile_definitions(test_engine PRIVATE KVP_ENGINE_DEFAULT_MODEL_DIR="${PROJECT_SOURCE_DIR}/models/kvp-tiny")
  # The byte-level BPE tokenizer (SmolLM2's vocabulary from KVP_SMOLLM2_GGUF; skips without it) and
  # hand-made vocabularies.
  kvp_add_test(test_tokenizer ${CMAKE_CURRENT_LIST_DIR}/test_bpe_tokenizer.cpp)
  target_link_libraries(test_tokenizer PRIVATE kvp_engine_lib nlohmann_json::nlohmann_json)
else()
  message(STATUS "kvpolicy: engine tests skipped (need the CPU backend and nlohmann-json)")
endif()
