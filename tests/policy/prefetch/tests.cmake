# Prefetch: the hit-rate history, Quest lookahead, InfiniGen, SpeCache, ShadowKV-style landmarks
# (hand-computed cases, bad input), the device paths of Quest lookahead and ShadowKV on the emulated device, and the
# offload simulator (eval/offload_sim.hpp).
kvp_add_test(test_prefetch
  ${CMAKE_CURRENT_LIST_DIR}/test_prefetch_history.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_prefetch_policies.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_prefetch_device.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_offload_sim.cpp)

# The four policies on the CPU backend against the scalar reference.
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_prefetch_cpu ${CMAKE_CURRENT_LIST_DIR}/test_prefetch_cpu.cpp)
endif()

# The prefetch loop inside the engine (examples/engine/prefetch.hpp) on kvp-tiny.
find_package(nlohmann_json 3 QUIET)
include(${PROJECT_SOURCE_DIR}/examples/engine/engine_lib.cmake)
if(TARGET kvp_engine_lib)
  kvp_add_test(test_prefetch_engine ${CMAKE_CURRENT_LIST_DIR}/test_prefetch_engine.cpp)
  target_link_libraries(test_prefetch_engine PRIVATE kvp_engine_lib nlohmann_json::nlohmann_json)
  target_include_directories(test_prefetch_engine PRIVATE ${PROJECT_SOURCE_DIR}/tools/compare)
  target_compile_definitions(test_prefetch_engine PRIVATE KVP_ENGINE_DEFAULT_MODEL_DIR="${PROJECT_SOURCE_DIR}/models/kvp-tiny")
endif()
