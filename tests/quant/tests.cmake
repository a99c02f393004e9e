# quant/: the element and block formats (byte-exact against the committed gguf-py / ml_dtypes fixtures) and the
# quantization policies built on them (tests/policy/quantization/), on every backend.
kvp_add_test(test_quant ${CMAKE_CURRENT_LIST_DIR}/test_ggml.cpp ${CMAKE_CURRENT_LIST_DIR}/test_fp8.cpp ${CMAKE_CURRENT_LIST_DIR}/test_kivi.cpp ${CMAKE_CURRENT_LIST_DIR}/test_int4.cpp ${CMAKE_CURRENT_LIST_DIR}/test_codecs_isa.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_ggml_quant.cpp ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_fp8_quant.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_token_rows.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_mixed_precision.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_quantized_keys.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_quantized_paged.cpp)
