# quant/: the block formats (byte-exact against the committed gguf-py fixtures) and their ops on every backend.
kvp_add_test(test_quant ${CMAKE_CURRENT_LIST_DIR}/test_ggml.cpp ${CMAKE_CURRENT_LIST_DIR}/../policy/quantization/test_ggml_quant.cpp)
