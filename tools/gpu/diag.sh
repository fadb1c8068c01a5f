#!/usr/bin/env bash
# GPU check, diagnosis: load the model in variants until one works, then run check.sh's tests
# and bench with that variant's environment.
set -u
export PYTHONPATH=$PWD:/tmp/gpu/llama:/tmp/gpu/site PYTHONUNBUFFERED=1
M=/tmp/gpu/m/model.gguf
try() {  # $1: label, $2: env assignments, $3: python kwargs
  echo "== $1"
  env $2 timeout 60 python3 -X faulthandler -c "
import llama_cpp
l = llama_cpp.Llama('$M', verbose=True, n_ctx=512, $3)
print('LOADED', l.create_completion('Hello', max_tokens=4)['choices'][0]['text'])
" > "$OUT/$1.log" 2>&1; rc=$?
  grep -v '^  File\|^llama_model_loader: - \|print_info' "$OUT/$1.log" | tail -6; echo "rc=$rc"; return $rc
}
ENVOK=""
if try gpu_nopinned "GGML_CUDA_NO_PINNED=1" "n_gpu_layers=-1"; then ENVOK="GGML_CUDA_NO_PINNED=1"
elif try gpu_nommap "GGML_CUDA_NO_PINNED=1" "n_gpu_layers=-1, use_mmap=False"; then ENVOK="GGML_CUDA_NO_PINNED=1"
elif try gpu_blocking "GGML_CUDA_NO_PINNED=1 CUDA_LAUNCH_BLOCKING=1" "n_gpu_layers=-1"; then ENVOK="GGML_CUDA_NO_PINNED=1 CUDA_LAUNCH_BLOCKING=1"
else try cpu_only "GGML_CUDA_NO_PINNED=1" "n_gpu_layers=0"; fi
echo "ENVOK=$ENVOK"
[ -n "$ENVOK" ] || exit 1
export $ENVOK
TEST_S=${TEST_S:-170} BENCH_S=${BENCH_S:-80} bash tools/gpu/check.sh
