#!/usr/bin/env bash
# Smoke test of DS4 speculation on one GPU through the CLI (device): ds4-tiny-a with its MTP head, greedy,
# plain and with --spec mtp / ngram; the outputs must be the same text.
set -u
. "$(dirname "$0")/carry_env.sh"
g="$c/shared/golden/ds4-tiny"
run() { local name=$1; shift; "$c/fathom" run -m "$g/ds4-tiny-a.gguf" --device cuda -p "The quick brown fox" -n 40 --temp 0 "$@" 2>"$out/smoke-$name.err"; }
plain=$(run plain --spec none); mtp=$(run mtp --spec mtp --draft-model "$g/ds4-tiny-a-mtp.gguf"); ngram=$(run ngram --spec ngram)
echo "plain: $plain" | head -c 300; echo
for f in "$out"/smoke-*.err; do echo "$(basename "$f"): $(tail -2 "$f" | tr '\n' ' ')"; done
[ "$plain" = "$mtp" ] && [ "$plain" = "$ngram" ] && echo "SAME OUTPUT" || { echo "OUTPUTS DIFFER"; exit 1; }
