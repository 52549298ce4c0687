# PFlash extra ctest entries (included from tests/CMakeLists.txt with `dir` = this directory).
#   pflash_niah_e2e   slow gate: 4K- and 8K-token 5-needle retrieval, PFlash keep 0.2 within 10 points of full
#                     prefill (Gemma3-270M target, SmolLM2-135M drafter); run with `ctest -L slow`
#   pflash_cli_*      the keep-ratio check on the CLI surfaces: NaN / Inf / negative / > 1 fail with
#                     a one-line error before any model is loaded
add_test(NAME pflash_niah_e2e
         COMMAND test_pflash --gtest_filter=pflash_niah_e2e.* --gtest_also_run_disabled_tests
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
# Labelled "heavy": tens of minutes on 2 cores; excluded from scripts/test.sh unless --all.
set_tests_properties(pflash_niah_e2e PROPERTIES LABELS "pflash;slow;heavy" TIMEOUT 3600)

if(TARGET fathom)
    set(_pflash_bad_ratios nan inf -inf -0.5 1.5)
    foreach(r ${_pflash_bad_ratios})
        string(REPLACE "-" "neg" _name "${r}")
        add_test(NAME pflash_cli_run_keep_ratio_${_name}
                 COMMAND $<TARGET_FILE:fathom> run -m gemma3 --pflash --keep-ratio=${r} -p hi
                 WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
        set_tests_properties(pflash_cli_run_keep_ratio_${_name} PROPERTIES LABELS pflash
                             PASS_REGULAR_EXPRESSION "error: --keep-ratio: must be")
        add_test(NAME pflash_cli_eval_keep_ratio_${_name}
                 COMMAND $<TARGET_FILE:fathom> eval niah --keep-ratios=0.2,${r}
                 WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
        set_tests_properties(pflash_cli_eval_keep_ratio_${_name} PROPERTIES LABELS pflash
                             PASS_REGULAR_EXPRESSION "error: --keep-ratios: (must be|'.*' is not a number)")
    endforeach()
endif()

# The --plot chart (src/pflash/plot.cpp) read back by an independent reader: tests/pflash/check_plot_svg.py
# (Python's XML parser) runs pflash_plot_tool, which writes charts, and checks that each is well-formed SVG
# of the layout's size with its title and labels (escaped) and one bar rect per mode and panel whose
# geometry follows the values; plus the unwritable-path error.
add_executable(pflash_plot_tool ${dir}/plot_tool.cpp)
target_include_directories(pflash_plot_tool PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(pflash_plot_tool PRIVATE fathom_core)
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
    add_test(NAME pflash_plot_svg
             COMMAND Python3::Interpreter ${dir}/check_plot_svg.py --tool $<TARGET_FILE:pflash_plot_tool>
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(pflash_plot_svg PROPERTIES LABELS pflash TIMEOUT 120)
endif()
if(TARGET fathom)
    # `--plot` into a missing directory fails with one line before any model is loaded.
    add_test(NAME pflash_cli_eval_plot_bad_path
             COMMAND $<TARGET_FILE:fathom> eval niah --plot /nonexistent-fathom-dir/out.svg
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(pflash_cli_eval_plot_bad_path PROPERTIES LABELS pflash
                         PASS_REGULAR_EXPRESSION "error: cannot write /nonexistent-fathom-dir/out.svg: directory")
endif()
