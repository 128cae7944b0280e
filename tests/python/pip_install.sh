#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `pip install .` works: builds a wheel of the source tree with scikit-build-core (no network: the
# build venv has it and nanobind), installs it into a fresh venv of the same interpreter (which
# sees the build venv's packages, torch among them, after its own), and trains a few steps there,
# outside the source and build trees. The wheel is built unoptimised (-O0): the test is of the
# packaging, and the optimised build is CI's release stage.
# usage: pip_install.sh PYTHON SOURCE_DIR WORK_DIR
set -euo pipefail
python=$1 source=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
"$python" -m pip wheel --quiet --no-build-isolation --no-deps -w "$work/wheel" "$source" \
  --config-settings=build-dir="$work/build" --config-settings=cmake.define.TASKSWAP_CUDA=OFF \
  --config-settings=cmake.build-type=Debug --config-settings=cmake.define.CMAKE_CXX_FLAGS_DEBUG=-O0
base=$("$python" -c "import sys; print(sys._base_executable)")
"$base" -m venv "$work/venv"
# The build venv's torch without installing it again (5 GB): its site-packages after the venv's own.
"$python" -c "import site; print('\n'.join(site.getsitepackages()))" \
  > "$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/build-venv.pth"
"$work/venv/bin/python" -m pip install --quiet --no-index --no-deps "$work"/wheel/taskswap-*.whl
cd "$work"
# No PYTHONPATH, no LD_LIBRARY_PATH: the venv's package, and libtaskswap through the RPATH $ORIGIN.
env -u PYTHONPATH -u LD_LIBRARY_PATH WORK="$work" "$work/venv/bin/python" - <<'PY'
import os
import taskswap, taskswap.torch as tt, torch
assert taskswap.__file__.startswith(os.path.join(os.environ["WORK"], "venv")), taskswap.__file__
opts = taskswap.parse_config('[device]\nbackend = "emulated"\nbudget = "64 KiB"\n')
rt = tt.Runtime(options=opts)
heads = [rt.register(torch.nn.Linear(8, 2), f"task/{t}") for t in range(4)]
before = {k: v.clone() for k, v in rt.state_dict().items()}
rt.plan([[heads[t % 4]] for t in range(8)])
for t in range(8):
    with rt.step(heads[t % 4]):
        heads[t % 4].module(torch.randn(3, 8)).square().mean().backward()
after = rt.state_dict()
assert all(not torch.equal(after[k], before[k]) for k in before)
print(f"pip-installed taskswap {taskswap.__version__} from {taskswap.__file__}: 8 steps trained")
PY
