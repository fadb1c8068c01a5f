#!/usr/bin/env bash
# GPU check, step 1 of 2 (device machine, repo root, .gpu carried: tools/gpu/prepare.sh made
# it): install the wheels, unpack the trimmed llama-cpp-python sdist and build it with CUDA in
# the background (its own process session), put the model in /tmp. Step 2 is
# tools/gpu/check.sh, in the same call: an idle machine is given back after 30 s.
set -eu
G=${GPU_DIR:-.gpu}
mkdir -p /tmp/gpu/m /tmp/gpu/src /tmp/gpu/site
cp "$G/model.gguf" /tmp/gpu/m/model.gguf
(cd /tmp/gpu/m && echo "$(cat "$OLDPWD/$G/model.sha256")  model.gguf" | sha256sum -c -)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu/site "$G"/*.whl
tar xzf "$G/llcpp.tar.gz" -C /tmp/gpu/src
cd /tmp/gpu/src/llama_cpp_python-*
# one architecture (Hopper) and no flash-attention kernels: the build then fits the device time
setsid nohup bash -c 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps \
  --no-cache-dir --target /tmp/gpu/llama . >/tmp/gpu/build.log 2>&1; echo $? >/tmp/gpu/build.rc' \
  </dev/null >/dev/null 2>&1 &
sleep 2; echo "build started"; nvidia-smi -L; nvcc --version | tail -1
