#!/usr/bin/env python3
"""Browser test of the chat page (web/index.html) served by `fathom serve` at /.

Headless Chromium (the Debian package `chromium`, at /usr/bin/chromium) driven by Playwright
(`pip install playwright`; no browser download: executable_path is the system Chromium). The test
  1. opens the page and waits for the model list;
  2. sets greedy sampling (temperature 0) and 160 max tokens, types a message and presses Send;
  3. watches the assistant bubble with a MutationObserver: the reply must arrive in several
     pieces (streamed), the meta line must report the generated tokens, no error bubble;
  4. checks the shown reply equals what the API returns for the same greedy request (so the page
     shows the server's text, not something else);
  5. sends a long request and presses Stop after the first piece: the meta line says 'stopped' and
     the server is idle again (the cancellation reached the scheduler);
  6. on a second server started with --api-key: the page opened without a key lists no model and
     says why; once the key is entered, the model list loads.

  python3 tests/server/web_test.py --fathom BUILD/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright

QUESTION = "What is the capital of France?"


def start_server(fathom, model, extra=()):
    proc = subprocess.Popen([fathom, "serve", "-m", model, "--port", "0", "--ctx", "1024", "--parallel", "2", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        m = re.search(r"listening on (http://[^ ]+)", line or "")
        if m:
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("fathom serve did not start")


def api_chat(url, content, max_tokens):
    req = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"messages": [{"role": "user", "content": content}],
                                                  "temperature": 0, "max_tokens": max_tokens}).encode())
    return json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"]["content"]


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def check_key_entry(browser, args, failures):
    """A server with --api-key: no models without the key; the list loads once the key is entered."""
    proc, url = start_server(args.fathom, args.model, ["--api-key", "web-test-key"])
    try:
        page = browser.new_page()  # another port: another origin, so no key saved in localStorage
        page.goto(url + "/")
        page.wait_for_selector(".msg.error", timeout=30000)
        if page.eval_on_selector_all("#model option", "els => els.length") != 0:
            failures.append("models listed without the API key")
        if "API key" not in page.inner_text(".msg.error"):
            failures.append("the missing key is not explained: %r" % page.inner_text(".msg.error"))
        page.fill("#apikey", "web-test-key")
        page.dispatch_event("#apikey", "change")
        try:
            page.wait_for_function("document.querySelectorAll('#model option').length > 0", timeout=30000)
        except Exception:
            failures.append("the model list did not load after the API key was entered")
        page.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    proc, url = start_server(args.fathom, args.model)
    failures = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function("document.querySelectorAll('#model option').length > 0", timeout=30000)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "160")  # long enough that a CPU-starved browser still sees several reads
            page.fill("#system", "")
            # Record every text the assistant bubble shows while the reply streams in.
            page.evaluate("""() => {
                window.__pieces = [];
                new MutationObserver(() => {
                    const a = document.querySelectorAll('.msg.assistant');
                    if (a.length) window.__pieces.push(a[a.length - 1].textContent);
                }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
            }""")
            page.fill("#input", QUESTION)
            page.click("#send")
            page.wait_for_selector(".meta", timeout=120000)
            reply = page.eval_on_selector_all(".msg.assistant", "els => els[els.length - 1].textContent")
            meta = page.inner_text(".meta")
            pieces = page.evaluate("window.__pieces")
            distinct = [t for i, t in enumerate(pieces) if t and (i == 0 or t != pieces[i - 1])]
            errors = page.query_selector_all(".msg.error")
            print("reply: %r\nmeta: %r\nstreamed updates: %d" % (reply, meta, len(distinct)))
            if errors:
                failures.append("error bubble: " + errors[0].inner_text())
            if not reply.strip():
                failures.append("empty reply")
            if len(distinct) < 3:
                failures.append("reply not streamed (only %d distinct updates)" % len(distinct))
            if not all(reply.startswith(t) for t in distinct):
                failures.append("streamed pieces are not prefixes of the final reply")
            if "generated tokens" not in meta:
                failures.append("meta line lacks usage: %r" % meta)
            expected = api_chat(url, QUESTION, 160)
            if reply != expected:
                failures.append("page shows %r but the API returns %r for the same greedy request" % (reply, expected))

            # Stop button: a long reply, stopped after its first piece.
            page.fill("#max_tokens", "400")
            page.click("#clear")
            page.fill("#input", "Write a very long story about a dragon and a knight.")
            page.click("#send")
            page.wait_for_function(
                "(() => { const a = document.querySelectorAll('.msg.assistant');"
                " return a.length && a[a.length - 1].textContent.length > 0; })()", timeout=120000)
            page.click("#stop")
            page.wait_for_selector(".meta", timeout=60000)
            meta2 = page.inner_text(".meta")
            print("after stop: %r" % meta2)
            if not meta2.startswith("stopped"):
                failures.append("stop did not stop the reply: %r" % meta2)
            deadline = time.time() + 10
            while time.time() < deadline and metric(url, "fathom_slots_busy") != 0:
                time.sleep(0.1)
            if metric(url, "fathom_slots_busy") != 0:
                failures.append("the stopped generation is still running on the server")
            check_key_entry(browser, args, failures)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAILED")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
