#!/usr/bin/env python3
"""Self-test of scripts/check_layers.py on a small synthetic tree (ctest layers_checker_selftest): a
downward include passes; a wrong-way include, an undeclared sideways one, an engine-internal header, a
cycle and a stale exception fail; an exception allows exactly its include."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "check_layers.py")


def write(root, path, text):
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


def run(root, layers_txt):
    write(root, "layers.txt", layers_txt)
    p = subprocess.run([sys.executable, CHECK, "--layers", os.path.join(root, "layers.txt"), "--root", root],
                       capture_output=True, text=True)
    return p.returncode, p.stderr


LAYERS = """layer\tcore\tt_core\t0
owns\tcore\tsrc/core
links\tcore\t
layer\tengine\tt_engine\t1
owns\tengine\tsrc/engine;include/fathom/engine.h
links\tengine\tt_core
layer\tserver\tt_server\t0
owns\tserver\tsrc/server
links\tserver\tt_engine;t_core
layer\tchat\tt_chat\t0
owns\tchat\tsrc/chat
links\tchat\tt_core
"""


def main():
    failures = []

    def expect(name, rc, err, want_fail, needle=""):
        ok = (rc != 0) == want_fail and needle in err
        if not ok:
            failures.append(f"{name}: rc={rc}, stderr:\n{err}")

    with tempfile.TemporaryDirectory() as root:
        write(root, "src/core/util.h", "#pragma once\n")
        write(root, "src/engine/internal.h", '#pragma once\n#include "core/util.h"\n')
        write(root, "include/fathom/engine.h", '#pragma once\n#include "core/util.h"\n')
        write(root, "src/server/server.cpp", '#include "fathom/engine.h"\n#include "core/util.h"\n#include <vector>\n')
        write(root, "src/chat/chat.cpp", '#include "core/util.h"\n')
        rc, err = run(root, LAYERS)
        expect("downward includes", rc, err, False)

        write(root, "src/core/bad.cpp", '#include "server/server.cpp"\n')
        rc, err = run(root, LAYERS)
        expect("wrong-way include", rc, err, True, 'layer "core" includes "server/server.cpp" of layer "server"')
        os.remove(os.path.join(root, "src/core/bad.cpp"))

        write(root, "src/chat/side.cpp", '#include "fathom/engine.h"\n')
        rc, err = run(root, LAYERS)
        expect("undeclared include", rc, err, True, "t_chat does not link t_engine")
        rc, err = run(root, LAYERS + "allow\tchat\tsrc/chat/side.cpp\tfathom/engine.h\tknown\n")
        expect("exception allows its include", rc, err, False)
        os.remove(os.path.join(root, "src/chat/side.cpp"))
        rc, err = run(root, LAYERS + "allow\tchat\tsrc/chat/side.cpp\tfathom/engine.h\tknown\n")
        expect("stale exception", rc, err, True, "remove the exception")

        write(root, "src/server/peek.cpp", '#include "engine/internal.h"\n')
        rc, err = run(root, LAYERS)
        expect("internal header", rc, err, True, "an internal header of layer \"engine\"")
        os.remove(os.path.join(root, "src/server/peek.cpp"))

        rc, err = run(root, LAYERS.replace("links\tcore\t\n", "links\tcore\tt_server\n"))
        expect("cycle", rc, err, True, "cycle")

    for f in failures:
        print("FAIL " + f, file=sys.stderr)
    print(f"test_check_layers: {7 - len(failures)}/7 cases pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
