#!/usr/bin/env bash
# Regenerate the committed llama.cpp oracle vectors (tiny and small, seed 1, f32 weights):
# 32 byte-level prompt ids + 300 greedy decode steps, llama.cpp v0.4.0 CPU, F32 KV cache,
# no flash attention, 2 threads, the portable x64 CPU variant.
# Needs: make (./ds4), tests/oracle/fetch_llama.sh + the llama_oracle build (make test does both).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=$(printf 'Once upon a time, in a land far a' | head -c 32 | od -An -tu1 | tr -s ' \n' ',' | sed 's/^,//;s/,$//')
for m in tiny small; do
  ./ds4 synth --config "$m" --seed 1 --type f32 -o "build/vec-$m.gguf"
  build/oracle/bin/llama_oracle -m "build/vec-$m.gguf" --tokens "$T" -n 300 --threads 2 \
      --cpu-backend x64 -o "tests/vectors/$m.llama.ds4logit"
done
