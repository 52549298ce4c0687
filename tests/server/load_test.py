#!/usr/bin/env python3
"""Reliability load test for `fathom serve` (loopback only, bounded duration, standard library only).

N clients (default 64) hammer a live server for --duration seconds with a random mix of OpenAI
chat (streaming and not), legacy completions and Anthropic messages, random max_tokens, and random
cancellations (a streaming client hangs up after a few chunks; a non-streaming one gives up after
a short timeout). Meanwhile --hostile clients (default 8) misbehave in turns: trickling header bytes
(closed at --header-timeout), trickling a body (408 at --body-timeout), a chunked body of 4 x
--max-body (413 while it is read) and an absurd Content-Length (413 at once); and a prober reads
/health every 0.25 s. Passes when:
  * no response has a 5xx status other than deliberate 503s (queue or KV pool full), and no stream
    carries an error frame; every 200 stream ends properly unless the client hung up itself;
  * afterwards the server is idle (/metrics: no busy slot, empty queue, no KV block reserved by a
    running request, no failed request) and still answers;
  * its anonymous resident memory is back to the baseline taken after a warm-up at full concurrency
    (tolerance --rss-tolerance-mib + 10%); skipped with --no-rss (sanitizer builds);
  * every hostile connection got its expected end in time, and /health always answered within 5 s;
  * it exits cleanly (status 0) on SIGTERM, with no sanitizer report on stderr.

  python3 tests/server/load_test.py --fathom BUILD/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf
      --duration 300          # full mode (5 minutes)
      --duration 30           # CI mode
"""
import argparse
import http.client
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

WORDS = ("apple river stone cloud music light garden window paper engine forest silver winter "
         "candle bridge ocean market letter mirror island").split()


class Server:
    def __init__(self, fathom, model, args):
        cmd = [fathom, "serve", "-m", model, "--port", "0", "--parallel", str(args.parallel),
               "--queue", str(args.queue), "--ctx", str(args.ctx), "--http-threads", str(args.clients + 16),
               "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
               "--max-body", str(MAX_BODY), "--max-conns-per-client", str(4 * (args.clients + args.hostile))]
        if args.threads:
            cmd += ["-t", str(args.threads)]
        cmd += args.serve_args.split()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr_lines = []
        deadline = time.time() + 300
        self.port = None
        while time.time() < deadline and self.port is None:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            self.stderr_lines.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr_lines))
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def rss_mib(self):
        # Anonymous resident memory: the heap, arenas, KV and scratch. Not VmRSS: it also counts the
        # model file's mapped pages, which grow as new tokens' embedding rows are first read (page
        # cache the kernel can drop, not memory the server holds on to).
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
        return 0.0

    def metrics(self):
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=30).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, val = line.rsplit(" ", 1)
                out[name] = float(val)
        return out

    def stop(self):
        self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -9
        self.reader.join(timeout=10)
        return rc


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = {}
        self.failures = []
        self.completed = self.cancelled = self.tokens = 0
        self.health_worst = 0.0

    def count(self, key):
        with self.lock:
            self.status[key] = self.status.get(key, 0) + 1

    def fail(self, msg):
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(msg)


def make_request(rng):
    kind = rng.choice(["chat", "chat_stream", "completion", "completion_stream", "anthropic_stream", "responses",
                       "responses_stream"])
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    max_tokens = rng.randint(1, 48)
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Tell me about " + text}], "max_tokens": max_tokens,
                "temperature": rng.choice([0, 0.7, 1.0]), "stream": kind.endswith("stream")}
    elif kind.startswith("completion"):
        path = "/v1/completions"
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]),
                "stream": kind.endswith("stream")}
    elif kind.startswith("responses"):
        # The Responses API; half the requests continue a recent first-turn response (the store under
        # concurrency; only first turns are continued, so prompts stay within the small context).
        path = "/v1/responses"
        body = {"input": "Tell me about " + text, "max_output_tokens": max_tokens,
                "temperature": rng.choice([0, 0.7]), "stream": kind.endswith("stream")}
        with RESPONSE_IDS_LOCK:
            if RESPONSE_IDS and rng.random() < 0.5:
                body["previous_response_id"] = rng.choice(RESPONSE_IDS)
    else:
        path = "/v1/messages"
        body = {"model": "x", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "stream": True}
        body.pop("model")  # let the server use the served model
    return kind, path, body


def one_request(port, rng, stats, cancel_p, deadline):
    kind, path, body = make_request(rng)
    if path == "/v1/messages":
        body["model"] = SERVED_MODEL[0]
    streaming = body.get("stream", False)
    cancel = rng.random() < cancel_p
    # The load phase is bounded: at the deadline (plus a grace period) clients hang up on whatever
    # is still running, which is one more cancellation for the server to handle.
    timeout = rng.uniform(0.05, 0.5) if (cancel and not streaming) else max(1.0, deadline + 5 - time.time())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        stats.count(resp.status)
        if resp.status >= 500 and resp.status != 503:
            stats.fail("%s -> %d %s" % (kind, resp.status, resp.read()[:300]))
            return
        if resp.status != 200:
            if resp.status == 400 and "previous_response_id" in body:  # evicted from the store: expected
                err = json.loads(resp.read()).get("error", {})
                if err.get("code") not in ("previous_response_not_found", "context_length_exceeded"):
                    stats.fail("%s -> 400 %s" % (kind, str(err)[:300]))
            elif resp.status != 503:
                stats.fail("%s -> %d %s" % (kind, resp.status, resp.read()[:300]))
            else:
                resp.read()
                time.sleep(rng.uniform(0.05, 0.3))  # back off like a real client instead of a 503 storm
            return
        if not streaming:
            obj = json.loads(resp.read())
            if "choices" not in obj and "content" not in obj and "output" not in obj:
                stats.fail("%s: unexpected body %s" % (kind, str(obj)[:200]))
            if obj.get("object") == "response" and "previous_response_id" not in body:
                remember_response(obj["id"])
            with stats.lock:
                stats.completed += 1
            return
        hang_up_after = rng.randint(0, 6) if cancel else None
        n, done = 0, False
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            if line == "event: error" or line.startswith('data: {"error"') or '"type": "error"' in line \
                    or '"type":"error"' in line or line == "event: response.failed":
                stats.fail("%s: error frame %s" % (kind, line[:300]))
                return
            if line == "data: [DONE]" or line == "event: message_stop":
                done = True
                break
            if line in ("event: response.completed", "event: response.incomplete"):
                done = True  # its data line (the whole response) follows; the stream ends after it
                final = next(resp, b"").decode("utf-8", "replace")
                if final.startswith("data: ") and "previous_response_id" not in body:
                    remember_response(json.loads(final[6:])["response"]["id"])
                break
            if line.startswith("data: "):
                n += 1
                if hang_up_after is not None and n >= hang_up_after:
                    with stats.lock:
                        stats.cancelled += 1
                    return  # close() below hangs up mid-stream
        if not done:
            stats.fail("%s: stream ended without its final frame" % kind)
        with stats.lock:
            stats.completed += 1
            stats.tokens += n
    except (socket.timeout, TimeoutError):
        if (cancel and not streaming) or time.time() > deadline:
            with stats.lock:
                stats.cancelled += 1
        else:
            stats.fail("%s: timed out" % kind)
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        stats.fail("%s: connection error %r" % (kind, e))
    finally:
        conn.close()


SERVED_MODEL = [""]
RESPONSE_IDS, RESPONSE_IDS_LOCK = [], threading.Lock()  # recent /v1/responses ids, for continuations


def remember_response(rid):
    with RESPONSE_IDS_LOCK:
        RESPONSE_IDS.append(rid)
        del RESPONSE_IDS[:-64]
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_BODY = 2, 3, 1 << 20


# ------------------------------------------------------------------------------------ hostile clients

def read_response(sock, limit):
    """Reads until the server closes (or `limit` seconds pass); returns (bytes, seconds)."""
    sock.settimeout(limit)
    t0, out = time.time(), b""
    try:
        while True:
            d = sock.recv(65536)
            if not d:
                break
            out += d
    except (socket.timeout, TimeoutError):
        out += b"<no close>"
    except OSError:
        pass
    return out, time.time() - t0


def trickle(sock, data, stop_after):
    """Sends data one byte every 50 ms until the server closes the socket or stop_after seconds."""
    t0 = time.time()
    for i in range(len(data)):
        if time.time() - t0 > stop_after:
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return
        time.sleep(0.05)


def send_quietly(sock, data):
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server answered 413 and closed while the rest was on its way


def hostile_once(port, rng, stats):
    kind = rng.choice(["slow_head", "slow_body", "big_chunked", "huge_length"])
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        if kind == "slow_head":
            t = threading.Thread(target=trickle, args=(s, b"GET /health HTTP/1.1\r\nX-Slow: " + b"z" * 400,
                                                         HEADER_TIMEOUT + 10), daemon=True)
            t.start()
            out, dt = read_response(s, HEADER_TIMEOUT + 8)
            ok = out == b"" and dt < HEADER_TIMEOUT + 6
        elif kind == "slow_body":
            s.sendall((head + "Content-Length: 5000\r\n\r\n").encode())
            t = threading.Thread(target=trickle, args=(s, b" " * 5000, BODY_TIMEOUT + 10), daemon=True)
            t.start()
            out, dt = read_response(s, BODY_TIMEOUT + 8)
            ok = out.startswith(b"HTTP/1.1 408") and dt < BODY_TIMEOUT + 6
        elif kind == "big_chunked":
            piece = b" " * 65536
            body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(4 * MAX_BODY // len(piece)))
            data = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + body + b"0\r\n\r\n"
            t = threading.Thread(target=send_quietly, args=(s, data), daemon=True)
            t.start()
            out, dt = read_response(s, 20)
            t.join(timeout=30)
            ok = out.startswith(b"HTTP/1.1 413")
        else:
            s.sendall((head + "Content-Length: 99999999999\r\n\r\n").encode())
            out, dt = read_response(s, 10)
            ok = out.startswith(b"HTTP/1.1 413") and dt < 4  # answered at once; closed after a 2 s linger
        stats.count("hostile " + kind)
        if not ok:
            stats.fail("hostile %s: %r after %.1f s" % (kind, out[:80], dt))
    except OSError as e:
        # A reset while the chunked body is still being sent is the server closing after its 413
        # (the client sees it only if it reads in time): accepted for that case only.
        if kind != "big_chunked":
            stats.fail("hostile %s: %r" % (kind, e))
    finally:
        s.close()


def probe_health(port, stats, deadline):
    worst = 0.0
    while time.time() < deadline:
        t0 = time.time()
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=30).read()
        except OSError as e:
            stats.fail("/health: %r" % e)
        worst = max(worst, time.time() - t0)
        time.sleep(0.25)
    if worst > 5:
        stats.fail("/health took %.1f s" % worst)
    with stats.lock:
        stats.health_worst = worst


def run_clients(port, clients, duration, cancel_p, seed, stats, hostile=0):
    deadline = time.time() + duration

    def client(i):
        rng = random.Random(seed * 1000 + i)
        while time.time() < deadline:
            one_request(port, rng, stats, cancel_p, deadline)

    def bad_client(i):
        rng = random.Random(seed * 1000 + 500 + i)
        while time.time() < deadline:
            hostile_once(port, rng, stats)

    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    ts += [threading.Thread(target=bad_client, args=(i,)) for i in range(hostile)]
    ts.append(threading.Thread(target=probe_health, args=(port, stats, deadline)))
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def wait_idle(srv, timeout):
    deadline = time.time() + timeout
    m = srv.metrics()
    while time.time() < deadline:
        m = srv.metrics()
        if m.get("fathom_slots_busy", 1) == 0 and m.get("fathom_queue_depth", 1) == 0:
            return m
        time.sleep(0.2)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--hostile", type=int, default=8, help="misbehaving clients alongside (0 = none)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load (300 = full mode)")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--queue", type=int, default=32, help="small on purpose: some 503s are expected")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cancel-p", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-rss", action="store_true", help="skip the memory check (sanitizer builds)")
    ap.add_argument("--rss-tolerance-mib", type=float, default=24.0)
    ap.add_argument("--serve-args", default="", help="extra `fathom serve` arguments, e.g. '--kv-mem 4'")
    args = ap.parse_args()

    srv = Server(args.fathom, args.model, args)
    ok = True
    try:
        SERVED_MODEL[0] = json.loads(urllib.request.urlopen(
            "http://127.0.0.1:%d/v1/models" % srv.port, timeout=30).read())["data"][0]["id"]
        # Warm-up at full concurrency: every slot, HTTP thread and allocator arena gets used once.
        warm = Stats()
        run_clients(srv.port, args.clients, args.warmup, args.cancel_p, args.seed + 7, warm, args.hostile)
        wait_idle(srv, 120)
        time.sleep(0.5)
        base = srv.rss_mib()
        print("warm-up: %s; baseline RSS %.1f MiB" % (dict(sorted(warm.status.items(), key=str)), base), flush=True)

        stats = Stats()
        t0 = time.time()
        run_clients(srv.port, args.clients, args.duration, args.cancel_p, args.seed, stats, args.hostile)
        elapsed = time.time() - t0
        m = wait_idle(srv, 120)
        time.sleep(0.5)
        after = srv.rss_mib()
        print("load: %.1f s, %d clients, statuses %s, completed %d, cancelled by client %d, stream frames %d"
              % (elapsed, args.clients, dict(sorted(stats.status.items(), key=str)), stats.completed, stats.cancelled,
                 stats.tokens), flush=True)
        print("worst /health latency %.2f s" % stats.health_worst, flush=True)
        print("metrics: submitted %d finished %d cancelled %d rejected %d failed %d; kv blocks used %d cached %d "
              "of %d" % tuple(m.get(k, -1) for k in (
                  "fathom_requests_submitted_total", "fathom_requests_finished_total",
                  "fathom_requests_cancelled_total", "fathom_requests_rejected_total",
                  "fathom_requests_failed_total", "fathom_kv_blocks_used", "fathom_kv_blocks_cached",
                  "fathom_kv_blocks_total")), flush=True)
        for f in stats.failures + warm.failures:
            print("FAIL:", f)
        if stats.failures or warm.failures:
            ok = False
        if stats.completed == 0:
            print("FAIL: no request completed")
            ok = False
        if m.get("fathom_slots_busy") != 0 or m.get("fathom_queue_depth") != 0:
            print("FAIL: server not idle after the load")
            ok = False
        if m.get("fathom_requests_failed_total", 1) != 0:
            print("FAIL: requests failed in the engine")
            ok = False
        if m.get("fathom_kv_blocks_used") != m.get("fathom_kv_blocks_cached"):
            print("FAIL: KV blocks still reserved with no request running")
            ok = False
        if not args.no_rss:
            limit = base * 1.10 + args.rss_tolerance_mib
            print("RSS after: %.1f MiB (baseline %.1f, limit %.1f)" % (after, base, limit))
            if after > limit:
                print("FAIL: resident memory did not come back to the baseline")
                ok = False
        # Still serving after all that.
        r = json.loads(urllib.request.urlopen(urllib.request.Request(
            "http://127.0.0.1:%d/v1/completions" % srv.port,
            data=json.dumps({"prompt": "hello", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"}), timeout=120).read())
        if "choices" not in r:
            print("FAIL: server no longer answers")
            ok = False
    finally:
        rc = srv.stop()
    err = "".join(srv.stderr_lines)
    if rc != 0:
        print("FAIL: server exited with status %s" % rc)
        ok = False
    if re.search(r"(AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:)", err):
        print("FAIL: sanitizer report:\n" + err[-8000:])
        ok = False
    print("PASS" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
