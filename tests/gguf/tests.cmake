# Extra GGUF checks (included by tests/CMakeLists.txt):
#  - gguf_samples: writes small GGUFs with the Fathom writer (also the fuzzing seed corpus).
#  - gguf_py_check: compares `fathom-gguf info --json` with gguf-py's GGUFReader on the shared files and
#    on gguf_samples' output. Needs python3 with `pip install gguf`; without it the test is reported as
#    skipped (exit 77), except under CI=true where it fails.
add_executable(gguf_samples ${CMAKE_CURRENT_LIST_DIR}/gguf_samples.cpp)
target_include_directories(gguf_samples PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(gguf_samples PRIVATE fathom_core)

find_program(FATHOM_PYTHON3 python3)
if(FATHOM_PYTHON3 AND TARGET fathom-gguf)
    add_test(NAME gguf_py_check
             COMMAND ${FATHOM_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/check_gguf_py.py
                     --tool $<TARGET_FILE:fathom-gguf> --samples $<TARGET_FILE:gguf_samples>
                     --shared ${FATHOM_SHARED_DIR})
    set_tests_properties(gguf_py_check PROPERTIES SKIP_RETURN_CODE 77 LABELS gguf TIMEOUT 300)
endif()

# fathom-gguf text mode: the llama-spm vocabulary's token array is listed with its length, and a
# non-GGUF file is rejected with the reader's one-line message.
if(TARGET fathom-gguf)
    add_test(NAME gguf_info_text
             COMMAND fathom-gguf info ${FATHOM_SHARED_DIR}/tokenizer-tests/ggml-vocab-llama-spm.gguf)
    set_tests_properties(gguf_info_text PROPERTIES LABELS gguf
        PASS_REGULAR_EXPRESSION "\"tokenizer\\.ggml\\.tokens\" array\\[string\\] \\(32000\\) = \\[\"<unk>\", \"<s>\", \"</s>\"")
    add_test(NAME gguf_info_rejects_non_gguf COMMAND fathom-gguf info ${PROJECT_SOURCE_DIR}/CMakeLists.txt)
    set_tests_properties(gguf_info_rejects_non_gguf PROPERTIES LABELS gguf WILL_FAIL TRUE)
endif()
