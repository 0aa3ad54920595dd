"""A non-editable install ships every module, kernel source and header: the wheel built
from this tree holds each Python file and each file of backends/cpu/x86 that a kernel build
reads (a wheel without them would silently run torch's fallback)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_every_module_kernel_source_and_header(tmp_path):
    # Built from a copy, so that setuptools' build/ and egg-info never land in the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("sluice-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = ROOT / "src" / "sluice" / "backends" / "cpu" / "x86"
    from sluice.backends.cpu.x86 import _files
    needed = {f"sluice/backends/cpu/x86/{rel.as_posix()}" for rel in _files(kernels)}
    on_disk = {f"sluice/backends/cpu/x86/{p.relative_to(kernels).as_posix()}" for p in kernels.rglob("*")
               if p.suffix in (".cpp", ".h")}
    assert needed == on_disk  # the build reads every source and header there is
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
    assert "sluice/backends/cpu/x86/avx2/avx512_on_avx2.h" in names
    # And every Python module (a package folder without __init__.py is left out by setuptools).
    package = ROOT / "src" / "sluice"
    modules = {f"sluice/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"
