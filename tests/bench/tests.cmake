# Python check of bench/llama_bench.py's output parsing (llama-bench and fathom bench), on recorded
# samples in tests/bench/data; never downloads or builds llama.cpp.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
    add_test(NAME bench_llama_bench_parse
             COMMAND Python3::Interpreter ${CMAKE_CURRENT_LIST_DIR}/test_llama_bench_parse.py
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(bench_llama_bench_parse PROPERTIES LABELS bench TIMEOUT 60)
endif()
