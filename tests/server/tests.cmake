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
if(Python3_FOUND AND TARGET fathom AND EXISTS ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf)
    # Thinking mode (reasoning split, budget, event sequences, second-turn cache hit) with the official
    # SDKs against `fathom serve` on ds4-tiny (docs/server.md "Thinking").
    add_test(NAME server_thinking_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/thinking_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_thinking_sdk PROPERTIES LABELS "server;slow" TIMEOUT 300)
endif()
if(Python3_FOUND AND TARGET fathom)
    # Chat page in headless Chromium (Debian `chromium`) driven by Playwright (`pip install playwright`).
    add_test(NAME server_web_page
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/web_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_web_page PROPERTIES LABELS "server;slow" TIMEOUT 300)
    # Reliability load test, CI mode (64 clients, random cancellations, 30 s); full mode: --duration 300.
    add_test(NAME server_load_ci
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/load_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf --duration 30
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_load_ci PROPERTIES LABELS "server;slow" TIMEOUT 600)
endif()
if(Python3_FOUND AND TARGET fathom)
    # Structured output (response_format json_object / json_schema, Anthropic output_format, forced tool-call
    # arguments) with the official SDKs, every output validated by the `jsonschema` package; a plain server
    # and one with --spec ngram (docs/server.md "Structured output"). SmolLM2: sensible JSON, Hermes tools.
    add_test(NAME server_structured_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/structured_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_structured_sdk PROPERTIES LABELS "server;slow" TIMEOUT 900)
endif()
if(Python3_FOUND AND TARGET fathom AND EXISTS ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf)
    # The same on ds4-tiny (random weights: gibberish that the constraint alone must make valid; DSML tools).
    add_test(NAME server_structured_ds4_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/structured_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf --tools dsml
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_structured_ds4_sdk PROPERTIES LABELS "server;slow" TIMEOUT 900)
endif()
