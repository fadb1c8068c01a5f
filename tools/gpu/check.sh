#!/usr/bin/env bash
# GPU check, step 2 of 2 (device machine, repo root, right after tools/gpu/start.sh in the same
# call): wait for the CUDA build, then with every layer offloaded (nbkv's default on a GPU
# build) run the exactness tests, then the bench: single and interleaved (IMC first token
# against cache off and Llama) and fixed-shape (every decode padded to one row count: does
# calibration prove exactness then). Logs go to $OUT. Budgets (seconds): BUILD_WAIT, TEST_S,
# BENCH_S; the whole must fit one call (tools/gpu/README.txt).
set -u
# The image's numpy, imported before llama.cpp's libraries, makes the first model load crash
# (seen on an H200, gVisor); a sitecustomize in /tmp/gpu/pre that loads llama.cpp first.
mkdir -p /tmp/gpu/pre && echo "import llama_cpp.llama_cpp  # noqa: F401" > /tmp/gpu/pre/sitecustomize.py
for i in $(seq 1 ${BUILD_WAIT:-330}); do [ -f /tmp/gpu/build.rc ] && break; sleep 1; done
tail -3 /tmp/gpu/build.log; cp /tmp/gpu/build.log "$OUT/build.log"
[ "$(cat /tmp/gpu/build.rc 2>/dev/null)" = 0 ] || { echo "build not done or failed"; exit 1; }
export GGML_CUDA_NO_PINNED=1  # ran with it; not shown to be needed
export PYTHONPATH=${PRE:-/tmp/gpu/pre}:$PWD:/tmp/gpu/llama:/tmp/gpu/site NBKV_MODEL=/tmp/gpu/m/model.gguf \
  NBKV_CACHE_DIR=/tmp/gpu/cache PYTHONUNBUFFERED=1
python3 -c "import llama_cpp, nbkv.llama.hardware as h; print('offload', h.gpu_offload(), [d.name for d in h.devices()])"
timeout ${TEST_S:-90} python3 -m pytest -q -p no:cacheprovider --timeout 80 ${TESTS:-tests/test_counters.py tests/test_llama_oracle.py} 2>&1 | tee "$OUT/tests.log" | tail -25
timeout ${BENCH_S:-150} python3 -m nbkv.bench --quick ${BENCH:---scenario single --scenario interleaved --scenario fixed-shape} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
