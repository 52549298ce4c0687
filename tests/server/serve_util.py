"""Starting a server process for the SDK tests: `launch(cmd)` runs it, waits for its "listening on" line
on stderr (the port it bound, --port 0), keeps draining stderr on a thread, and returns (process, base URL).
Raises RuntimeError with what the process printed when it exits or does not start within `timeout` s."""
import re
import subprocess
import threading
import time


def launch(cmd, pattern=r"listening on http://[^:]+:(\d+)", timeout=300):
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline, lines = time.time() + timeout, []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(" ".join(cmd) + " exited: " + "".join(lines))
            continue
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, f"http://127.0.0.1:{m.group(1)}"
    proc.kill()
    raise RuntimeError(" ".join(cmd) + " did not start: " + "".join(lines))
