#!/usr/bin/env bash
# The whole GPU check in one go, for whoever has a CUDA machine: the CUDA tests, then the GPU
# benchmarks; everything (device facts, build log, test log, results JSON, bench log) goes to
# one output folder. Runs with the machine's own python3 (PyTorch with CUDA); packages it lacks
# may be carried as wheels in .whl/gpu/ (installed into /tmp/kvstore-site, nothing else touched).
#
#   bench/gpu_check.sh OUT_DIR [--quick] [more bench/gpu_tiers.py arguments]
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR [--quick] [gpu_tiers.py arguments]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/gpu/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvstore-site .whl/gpu/*.whl >"$out/wheels.log" 2>&1 || echo "wheels: see wheels.log"
  export PYTHONPATH=/tmp/kvstore-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } >"$out/device.txt" 2>&1
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || echo "native build failed: see build.log"
status=0
"$py" -m pytest -q -p no:cacheprovider -o addopts="" tests/kvstore/gpu tests/engine/gpu \
  --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.log" || status=1
"$py" bench/gpu_tiers.py --out "$out/gpu_tiers.json" "$@" 2>&1 | tee "$out/bench.log" || status=1
exit $status
