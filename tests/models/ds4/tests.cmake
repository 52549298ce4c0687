# Black-box DS4 check through the binaries, driven by tests/models/ds4/check_cli.py (included from
# tests/CMakeLists.txt with `dir` = this directory):
#   ds4_cli  `fathom logits` on ds4-tiny-a in prefill/decode/chunked:7 vs the goldens (--qat off and
#            fp4only), and `fathom-gguf synth --preset tiny` (deterministic, loads, finite logits)
#   ds4_cli_drafters (check_cli_drafters.py)  `fathom logits --mtp` / `--dspark` vs the MTP and DSpark
#            goldens, `fathom-gguf synth --dspark` drafters through `logits --dspark`, and `synth --mtp`
#            targets through `logits --mtp` and `run --spec mtp` (the plain run's text)
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND AND TARGET fathom AND TARGET fathom-gguf)
    add_test(NAME ds4_cli
             COMMAND Python3::Interpreter ${dir}/check_cli.py --fathom $<TARGET_FILE:fathom>
                     --fathom-gguf $<TARGET_FILE:fathom-gguf> --shared ${FATHOM_SHARED_DIR}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(ds4_cli PROPERTIES LABELS ds4 TIMEOUT 300)
    add_test(NAME ds4_cli_drafters
             COMMAND Python3::Interpreter ${dir}/check_cli_drafters.py --fathom $<TARGET_FILE:fathom>
                     --fathom-gguf $<TARGET_FILE:fathom-gguf> --shared ${FATHOM_SHARED_DIR}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(ds4_cli_drafters PROPERTIES LABELS ds4 TIMEOUT 300)
endif()
