# tests/server: the model-free GoogleTest suite (test_server) needs cpp-httplib for its client;
# the Python integration tests drive a live `fathom serve` with the official openai/anthropic SDKs
# on the default real model and are labelled "slow".
if(TARGET test_server)
    target_link_libraries(test_server PRIVATE httplib::httplib)
endif()
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND AND TARGET fathom)
    add_test(NAME server_integration_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/integration_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_integration_sdk PROPERTIES LABELS "server;slow" TIMEOUT 900)
endif()
