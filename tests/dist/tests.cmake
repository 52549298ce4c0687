# Black-box check of `fathom plan` (tests/dist/check_plan_cli.py, gguf-py as the independent reader of
# the tensor directory). Included from tests/CMakeLists.txt with `dir` = this directory.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND AND TARGET fathom)
    add_test(NAME dist_plan_cli
             COMMAND Python3::Interpreter ${dir}/check_plan_cli.py --fathom $<TARGET_FILE:fathom>
                     --shared ${FATHOM_SHARED_DIR}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(dist_plan_cli PROPERTIES LABELS dist TIMEOUT 60)
    # `--devices` through the binary (tests/dist/check_devices_cli.py): same greedy text and logits as
    # one device on ds4-tiny, golden logits, one-line errors for bad inputs.
    add_test(NAME dist_devices_cli
             COMMAND Python3::Interpreter ${dir}/check_devices_cli.py --fathom $<TARGET_FILE:fathom>
                     --shared ${FATHOM_SHARED_DIR} --dense ${PROJECT_SOURCE_DIR}/tests/models/data/tiny_qwen3.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(dist_devices_cli PROPERTIES LABELS dist TIMEOUT 120)
    # `--procs` (ranks as child processes over the socket transport; tests/dist/check_procs_cli.py): run /
    # logits bit-identical to the in-process ranks, serve answers identically, a killed rank ends serve
    # with one line, no rank process is left behind.
    add_test(NAME dist_procs_cli
             COMMAND Python3::Interpreter ${dir}/check_procs_cli.py --fathom $<TARGET_FILE:fathom>
                     --shared ${FATHOM_SHARED_DIR}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(dist_procs_cli PROPERTIES LABELS dist TIMEOUT 180)
endif()
# test_dist spawns `fathom rank` processes (the engine's --procs in flight, test_dist_inflight.cpp).
if(TARGET fathom AND TARGET test_dist)
    target_compile_definitions(test_dist PRIVATE FATHOM_CLI="$<TARGET_FILE:fathom>")
    add_dependencies(test_dist fathom)
endif()

# NCCL transport (src/dist/nccl_transport.cc; the .cc extension keeps it out of fathom_core's *.cpp
# glob, which has no NCCL) and its two-process smoke test, built only with -DFATHOM_CUDA=ON where
# nccl.h and libnccl are found. Not registered in ctest: it needs GPUs (one rank per GPU); see
# docs/dist.md for how it was run.
if(FATHOM_CUDA)
    find_path(FATHOM_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(FATHOM_NCCL_LIB nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_DIR}/../lib)
    if(FATHOM_NCCL_INCLUDE AND FATHOM_NCCL_LIB)
        add_library(fathom_dist_nccl STATIC ${PROJECT_SOURCE_DIR}/src/dist/nccl_transport.cc)
        target_include_directories(fathom_dist_nccl PUBLIC ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include
                                   ${FATHOM_NCCL_INCLUDE})
        target_link_libraries(fathom_dist_nccl PUBLIC fathom_core CUDA::cudart ${FATHOM_NCCL_LIB})
        add_executable(dist_nccl_smoke ${dir}/nccl_smoke.cc)
        target_link_libraries(dist_nccl_smoke PRIVATE fathom_dist_nccl)
        # DS4 pipeline split over two processes/GPUs vs. the unsplit forward (tests/dist/nccl_pipeline.cc).
        # Run from the repository root after scripts/device/pack_x2.sh, which copies the ds4-tiny golden
        # to .x2-carry/shared (the device has no ../shared), hence the relative FATHOM_SHARED_DIR.
        add_executable(dist_nccl_pipeline ${dir}/nccl_pipeline.cc)
        target_include_directories(dist_nccl_pipeline PRIVATE ${PROJECT_SOURCE_DIR}/tests)
        target_compile_definitions(dist_nccl_pipeline PRIVATE FATHOM_SHARED_DIR=".x2-carry/shared")
        target_link_libraries(dist_nccl_pipeline PRIVATE fathom_dist_nccl nlohmann_json::nlohmann_json)
    else()
        message(STATUS "NCCL not found: fathom_dist_nccl and dist_nccl_smoke are not built")
    endif()
endif()
