#!/usr/bin/env bash
# CUDA ranks as processes (`--procs` with CUDA entries in --devices) on ONE GPU, in one device call:
# tests/dist/check_procs_cli.py --cuda (every CUDA entry is cuda:0, so two or three processes share the
# device; the socket transport, no NCCL): `fathom run` greedy text of --devices cuda:0,cuda:0[,cuda:0]
# --procs = one device = in-process; cpu,cuda:0 / cuda:0,cpu --procs = in-process; `fathom logits`
# --procs memcmp-equal to in-process; `fathom serve --devices cuda:0,cuda:0 --procs` answers as in-process
# and exits 1 with the one-line dist error within 5 s of its rank process being SIGKILLed; a hand-started
# CUDA rank (--procs-local) joins; refusals are one line. Prints PASS / FAIL per case; exit status 1 on a
# failure. Needs only .cuda-carry (scripts/device/pack_cuda.sh: fathom and the ds4-tiny golden under
# .cuda-carry/shared/golden/ds4-tiny), or .cuda-pack/carry.tgz, and python3 (no numpy).
# Usage (device): bash scripts/device/run_procs_cuda.sh [cuda:N]   (log: $OUT/procs_cuda.log)
set -u
gpu="${1:-cuda:0}"
carry_bin=fathom
. "$(dirname "$0")/carry_env.sh"
for f in "$c/fathom" "$c/shared/golden/ds4-tiny/ds4-tiny-a.gguf" "$c/shared/golden/ds4-tiny/cases.jsonl"; do
    [ -e "$f" ] || { echo "FAIL: $f missing (scripts/device/pack_cuda.sh)"; exit 1; }
done
timeout "${PROCS_TIMEOUT:-170}" python3 "$here/tests/dist/check_procs_cli.py" --fathom "$c/fathom" \
    --shared "$c/shared" --cuda "$gpu" 2>&1 | tee "$out/procs_cuda.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "FAIL: check_procs_cli.py --cuda ran past ${PROCS_TIMEOUT:-170} s"
# No rank process may outlive the checks (nor a server left by a timeout): only this carry's binary.
left=$(pgrep -f "^$c/fathom " || true)
[ -n "$left" ] && { echo "FAIL: fathom processes left: $(echo $left)"; kill -9 $left; rc=1; }
exit "$rc"
