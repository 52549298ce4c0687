#!/usr/bin/env bash
# Two-GPU distributed tests in ONE device call (binaries from scripts/device/pack_x2.sh in .x2-carry/):
#   1. dist_nccl_smoke pair: NCCL send/recv between cuda:0 and cuda:1 (1 MiB both ways) + silent-peer deadline
#   2. dist_nccl_pipeline: DS4 pipeline split over 2 processes/GPUs vs. the unsplit single-process run,
#      bit for bit (synthetic reduced geometry; ds4-tiny golden 300-token case, also vs. the official logits)
#   3. a rank SIGKILLed mid-run (rank 1, then rank 0): the survivor must exit at once with a one-line
#      error naming the dead peer (rc 4; the liveness side channel, src/dist/liveness.h) -- rank 1 too,
#      which idles in recv_idle without a deadline; a verdict line checks rc, message and seconds
# Every process runs under `timeout`, so a hang shows as rc 124 instead of eating the device budget.
# NCCL_NVLS_ENABLE=0 throughout. Logs in $OUT (device tool) or ./x2-out; summary in $OUT/summary.txt.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
carry=.x2-carry
out="${OUT:-$here/x2-out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export LD_LIBRARY_PATH="$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
if ldd "$carry/dist_nccl_pipeline" | grep -q "libnccl.so.2 => not found"; then
    d=$(find /usr/local /opt /usr/lib /usr/lib64 -name libnccl.so.2 2>/dev/null | head -1)
    [ -z "$d" ] && d=$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"lib","libnccl.so.2"))' 2>/dev/null)
    [ -n "$d" ] && export LD_LIBRARY_PATH="$(dirname "$d"):$LD_LIBRARY_PATH"
fi
sum="$out/summary.txt"
log() { echo "$*" | tee -a "$sum"; }
nvidia-smi -L 2>&1 | tee "$out/gpu.txt"
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
ldd "$carry/dist_nccl_pipeline" | grep -E "nccl|not found" | tee -a "$sum"
P="$carry/dist_nccl_pipeline"

# Unsplit references (CPU only) in the background while the GPUs run the smoke test.
( timeout 120 "$P" ref synth "$out/synth.bin.ref" > "$out/ref_synth.log" 2>&1; echo $? > "$out/ref_synth.rc" ) &
ref1=$!
( timeout 150 "$P" ref golden "$out/golden.bin.ref" > "$out/ref_golden.log" 2>&1; echo $? > "$out/ref_golden.rc" ) &
ref2=$!

# pair NAME TIMEOUT CMD0 -- CMD1: runs rank 0 and rank 1 concurrently, logs rc and seconds of each.
pair() {
    local name=$1 lim=$2; shift 2
    local a=() b=()
    while [ "$1" != "--" ]; do a+=("$1"); shift; done; shift
    b=("$@")
    rm -f "$out/$name.id"
    local t0=$(date +%s.%N)
    ( timeout -s KILL "$lim" "${a[@]}" > "$out/$name.r0.log" 2>&1; echo "$? $(date +%s.%N)" > "$out/$name.r0.rc" ) &
    local p0=$!
    ( timeout -s KILL "$lim" "${b[@]}" > "$out/$name.r1.log" 2>&1; echo "$? $(date +%s.%N)" > "$out/$name.r1.rc" ) &
    local p1=$!
    wait $p0 $p1
    for r in 0 1; do
        read -r rc t1 < "$out/$name.r$r.rc"
        awk "BEGIN{printf \"%.1f\", $t1 - $t0}" > "$out/$name.r$r.s"
        log "== $name rank $r: rc $rc after $(cat "$out/$name.r$r.s") s"
        sed 's/^/   /' "$out/$name.r$r.log" | tail -6 | tee -a "$sum"
    done
}

# expect NAME RANK RC MAX_S PATTERN: verdict on a failure case run by pair (rc, seconds since the pair
# started, and an extended regex the rank's log must match).
expect() {
    local name=$1 r=$2 want=$3 max=$4 pat=$5 rc t1 s
    read -r rc t1 < "$out/$name.r$r.rc"
    s=$(cat "$out/$name.r$r.s")
    if [ "$rc" = "$want" ] && awk "BEGIN{exit !($s <= $max)}" && grep -Eq "$pat" "$out/$name.r$r.log"; then
        log "== $name: rank $r OK (rc $rc after $s s, within $max s, log matches '$pat')"
    else
        log "== $name: rank $r UNEXPECTED (rc $rc after $s s; want rc $want within $max s and '$pat' in the log)"
    fi
}

S="$carry/dist_nccl_smoke"
pair smoke 40 "$S" pair 0 "$out/smoke.id" -- "$S" pair 1 "$out/smoke.id"
wait $ref1
log "== ref synth: rc $(cat "$out/ref_synth.rc"): $(tail -1 "$out/ref_synth.log")"
pair synth 60 "$P" rank 0 "$out/synth.id" synth "$out/synth.bin" -- "$P" rank 1 "$out/synth.id" synth "$out/synth.bin"
# The dying rank SIGKILLs itself 3 s after joining (~1 s): the survivor must fail well before its 5 s
# deadline would end a wait (die1) and before the harness's 15 s hang guard (die0: rank 1 idles in
# recv_idle, on which NCCL reports nothing; before the side channel it was killed here with rc 137).
pair die1 30 "$P" loop 0 "$out/die1.id" 1 3 -- "$P" loop 1 "$out/die1.id" 1 3
expect die1 0 4 8 "peer rank 1 \(pid [0-9]+, host .*\) exited"
pair die0 15 "$P" loop 0 "$out/die0.id" 0 3 -- "$P" loop 1 "$out/die0.id" 0 3
expect die0 1 4 8 "peer rank 0 \(pid [0-9]+, host .*\) exited"
wait $ref2
log "== ref golden: rc $(cat "$out/ref_golden.rc"): $(tail -1 "$out/ref_golden.log")"
pair golden 90 "$P" rank 0 "$out/golden.id" golden "$out/golden.bin" -- "$P" rank 1 "$out/golden.id" golden "$out/golden.bin"
# CUDA stages (ds4::cuda_sequence per rank): the single-GPU CUDA run is the reference, bit for bit.
for m in synth golden; do
    timeout 120 "$P" ref $m "$out/c$m.bin.ref" cuda > "$out/ref_c$m.log" 2>&1
    log "== ref $m on cuda:0: rc $?: $(tail -1 "$out/ref_c$m.log")"
    pair c$m 120 "$P" rank 0 "$out/c$m.id" $m "$out/c$m.bin" cuda -- "$P" rank 1 "$out/c$m.id" $m "$out/c$m.bin" cuda
done
rm -f "$out"/*.bin "$out"/*.bin.ref
log "done"
