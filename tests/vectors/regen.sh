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

# The quantised-model twins (tests/test_quant_oracle.py): llama.cpp's greedy dumps on the
# libggml-dequantised twins of small-q2 / small-q4 (ds4 synth and libggml requantised), made by
# the test itself with QO_LIVE=1 (on an otherwise idle machine: llama.cpp's threads spin), and the SHA-256 of the quantised files
# they belong to.
QO_LIVE=1 bash tests/run_pytest.sh -q tests/test_quant_oracle.py -k twin_agrees
: > tests/vectors/qo.sha256
for v in q2-synth q4-synth q2-ggml q4-ggml; do
  cp "build/test-out/qo-$v.twin.llama.ds4logit" tests/vectors/
  (cd build/test-out && sha256sum "qo-$v.gguf") >> tests/vectors/qo.sha256
done
