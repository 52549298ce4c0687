# tests/server: the model-free GoogleTest suite (test_server) needs cpp-httplib for its client;
# the Python integration tests drive a live `fathom serve` with the official openai/anthropic SDKs
# on the default real model and are labelled "slow".
if(TARGET test_server)
    target_link_libraries(test_server PRIVATE httplib::httplib)
    # The HTTP server over the fake engine, for SDK tests that choose the model's output (test-only).
    add_executable(fathom_fake_serve ${CMAKE_CURRENT_LIST_DIR}/fake_serve.cpp)
    target_include_directories(fathom_fake_serve PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
    target_link_libraries(fathom_fake_serve PRIVATE fathom_core httplib::httplib nlohmann_json::nlohmann_json)
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
if(Python3_FOUND AND TARGET fathom_fake_serve AND TARGET fathom AND EXISTS ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf)
    # Streamed tool calls (OpenAI delta.tool_calls, Anthropic input_json_delta), parallel_tool_calls,
    # tool_choice and SSE keepalives with the official SDKs: against the HTTP server over the fake engine
    # posing as DS4 (its output chosen by the test), and `fathom serve` on ds4-tiny for a forced call.
    add_test(NAME server_tool_stream_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/tool_stream_test.py
                     --fake-serve $<TARGET_FILE:fathom_fake_serve>
                     --fathom $<TARGET_FILE:fathom>
                     --model ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_tool_stream_sdk PROPERTIES LABELS "server;slow" TIMEOUT 300)
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
    # POST /v1/responses with the official openai SDK: SmolLM2 for text, tools and continuation, plus
    # ds4-tiny for reasoning items when the shared goldens are there (docs/server.md "Responses API").
    set(FATHOM_RESPONSES_DS4 ${FATHOM_SHARED_DIR}/golden/ds4-tiny/ds4-tiny-a.gguf)
    if(EXISTS ${FATHOM_RESPONSES_DS4})
        set(FATHOM_RESPONSES_DS4_ARGS --ds4 ${FATHOM_RESPONSES_DS4})
    endif()
    add_test(NAME server_responses_sdk
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/responses_test.py
                     --fathom $<TARGET_FILE:fathom>
                     --model ${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf
                     ${FATHOM_RESPONSES_DS4_ARGS}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(server_responses_sdk PROPERTIES LABELS "server;slow" TIMEOUT 600)
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
