# Python-driven check for the chat template goldens (included from tests/CMakeLists.txt with
# `dir` = this directory):
#   chat_template_refs_current  re-renders every case of tests/chat/data/*.json with Python jinja2 in
#                               transformers' environment (scripts/gen_template_refs.py --check) and
#                               fails if the committed files are stale; skipped (77) without jinja2.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
    add_test(NAME chat_template_refs_current
             COMMAND Python3::Interpreter ${PROJECT_SOURCE_DIR}/scripts/gen_template_refs.py --check
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(chat_template_refs_current PROPERTIES LABELS chat TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
