#!/usr/bin/env bash
# GPU check, step 2 of 2 (device machine, repo root, .gpu2 carried, after tools/gpu/start.sh):
# wait for the CUDA build, put the model together, then run the exactness tests and the bench
# with every layer offloaded (nbkv's default on a GPU build). Logs go to $OUT.
set -u
# The image's numpy, imported before llama.cpp's libraries, makes the first model load crash
# (seen on an H200, gVisor); a sitecustomize in /tmp/gpu/pre that loads llama.cpp first.
mkdir -p /tmp/gpu/pre && echo "import llama_cpp.llama_cpp  # noqa: F401" > /tmp/gpu/pre/sitecustomize.py
[ -f /tmp/gpu/m/smollm2.gguf ] || cat /tmp/gpu/m/model.a .gpu2/model.b > /tmp/gpu/m/smollm2.gguf
[ -f /tmp/gpu/m/sha.ok ] || { echo "$(cat .gpu2/model.sha256)  /tmp/gpu/m/smollm2.gguf" | sha256sum -c - && touch /tmp/gpu/m/sha.ok; } || exit 1
for i in $(seq 1 ${BUILD_WAIT:-480}); do [ -f /tmp/gpu/build.rc ] && break; sleep 1; done
tail -3 /tmp/gpu/build.log; cp /tmp/gpu/build.log "$OUT/build.log"
[ "$(cat /tmp/gpu/build.rc 2>/dev/null)" = 0 ] || { echo "build not done or failed"; exit 1; }
export GGML_CUDA_NO_PINNED=1  # ran with it; not shown to be needed
export PYTHONPATH=${PRE:-/tmp/gpu/pre}:$PWD:/tmp/gpu/llama:/tmp/gpu/site NBKV_MODEL=/tmp/gpu/m/smollm2.gguf \
  NBKV_CACHE_DIR=/tmp/gpu/cache PYTHONUNBUFFERED=1
python3 -c "import llama_cpp, nbkv.llama.hardware as h; print('offload', h.gpu_offload(), [d.name for d in h.devices()])"
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 ${TESTS:-tests/test_llama_oracle.py tests/test_quants.py tests/test_families.py tests/test_engine.py} 2>&1 | tee "$OUT/tests.log" | tail -40
timeout ${BENCH_S:-150} python3 -m nbkv.bench --quick ${BENCH:---scenario single --scenario interleaved --scenario back-to-back --scenario decode} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -60
