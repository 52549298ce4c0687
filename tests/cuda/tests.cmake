# tests/cuda (only reached with -DFATHOM_CUDA=ON; see tests/CMakeLists.txt): test_cuda is the
# GoogleTest suite (op-by-op vs the CPU backend, CUDA-graph replay; skips without a device).
# bench_cuda measures decode GEMV bandwidth against the device copy bandwidth (not a ctest).
add_executable(bench_cuda ${CMAKE_CURRENT_SOURCE_DIR}/cuda/bench_cuda.cpp)
target_include_directories(bench_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(bench_cuda PRIVATE fathom_core)
# cuda_synth writes real-geometry synthetic models for `fathom bench --device cuda` on the device.
add_executable(cuda_synth ${CMAKE_CURRENT_SOURCE_DIR}/cuda/cuda_synth.cpp)
target_include_directories(cuda_synth PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(cuda_synth PRIVATE fathom_core)
target_compile_definitions(cuda_synth PRIVATE FATHOM_SHARED_DIR="${FATHOM_SHARED_DIR}")
# bench_cuda_ds4: DS4 decode at context frontiers on the device (ds4::cuda_sequence), against the roofline.
add_executable(bench_cuda_ds4 ${CMAKE_CURRENT_SOURCE_DIR}/cuda/bench_cuda_ds4.cpp)
target_include_directories(bench_cuda_ds4 PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(bench_cuda_ds4 PRIVATE fathom_core)
# bench_pflash_cuda: PFlash (GPU drafter) vs full prefill TTFT with a DS4 target on the device.
add_executable(bench_pflash_cuda ${CMAKE_CURRENT_SOURCE_DIR}/cuda/bench_pflash_cuda.cpp)
target_include_directories(bench_pflash_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
target_link_libraries(bench_pflash_cuda PRIVATE fathom_core)
