#!/usr/bin/env bash
# GPU check, step 0 (on the development machine, not the device): put what ONE device call
# needs into .gpu/ (ignored through .git/info/exclude; the call names it in `carry`), under the
# call's 64 MiB with the working tree:
#   .gpu/llcpp.tar.gz  llama-cpp-python's sdist (the installed version), trimmed to what a CUDA
#                      build compiles (no model vocabularies, docs, tests, other backends)
#   .gpu/*.whl         pure-Python wheels the device image may lack (llama_cpp's diskcache,
#                      gguf, pytest-timeout, hypothesis and theirs)
#   .gpu/model.gguf    the embedded SmolLM2 Q4_1's first $LAYERS of 30 layers (its own weights,
#                      types and tokenizer: the model whole is 98 MB), and model.sha256
# Then: tools/gpu/start.sh and tools/gpu/check.sh in one call (tools/gpu/README.txt).
set -eu
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
LAYERS=${LAYERS:-8}
VER=$($PY -c "import llama_cpp; print(llama_cpp.__version__)")
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
rm -rf .gpu /tmp/gpuprep && mkdir -p .gpu /tmp/gpuprep/src
$PY -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d /tmp/gpuprep
tar xzf /tmp/gpuprep/llama_cpp_python-"$VER".tar.gz -C /tmp/gpuprep/src
S=/tmp/gpuprep/src/llama_cpp_python-$VER
V=$S/vendor/llama.cpp
rm -rf "$S"/{docs,examples,tests,docker,.git,.github} "$V"/{models,docs,media,benches,tests,examples,pocs,.github} \
  "$V"/{gguf-py,conversion,scripts,app,.git}
find "$V/tools" -mindepth 1 -maxdepth 1 ! -name mtmd -exec rm -rf {} +
for b in metal sycl vulkan opencl hexagon et cann musa webgpu zdnn hip kompute blas rpc virtgpu; do
  rm -rf "$V/ggml/src/ggml-$b"
done
tar czf .gpu/llcpp.tar.gz -C /tmp/gpuprep/src "llama_cpp_python-$VER"
$PY -m pip download -q --only-binary :all: --no-deps -d .gpu diskcache gguf pytest-timeout \
  hypothesis sortedcontainers attrs platformdirs
ls .gpu/*.whl | grep -v -- '-none-any.whl' | xargs -r rm -f  # the device's Python may differ
SRC=$($PY -c "from nbkv.llama.models import default_model_path; print(default_model_path())")
$PY tools/gpu/truncate.py "$SRC" .gpu/model.gguf "$LAYERS"
(cd .gpu && sha256sum model.gguf | cut -d' ' -f1 > model.sha256)
du -sh .gpu; du -cb .gpu/* | tail -1
