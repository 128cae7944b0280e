# SPDX-License-Identifier: Apache-2.0
"""The committed type stubs (python/taskswap/_core.pyi) are what nanobind.stubgen makes of the built
extension. Regenerate: python3 -m nanobind.stubgen -m taskswap._core -o FILE, under the header."""

import subprocess
import sys
import tempfile
from pathlib import Path

committed = Path(sys.argv[1]).read_text().splitlines()
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "_core.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "taskswap._core", "-o", str(out)], check=True)
    fresh = out.read_text().splitlines()
body = [line for line in committed if not line.startswith("# ")][: len(fresh)]
if body != fresh or len([line for line in committed if not line.startswith("# ")]) != len(fresh):
    sys.exit(f"{sys.argv[1]} is out of date with the extension; regenerate it (see {__file__})")
print("stubs current")
