"""Optional C++ kernels, compiled on first use with torch's extension builder.

If a compiler is missing or the build fails, `load()` returns None and callers fall
back to the torch implementation; nothing else depends on the kernels being present.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def load():
    # torch runs `ninja` from PATH; the pip-installed one sits beside the interpreter,
    # which is not on PATH when the venv is used without being activated.
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load as load_extension
        return load_extension(
            name="sluice_cpu_kernels",
            sources=[str(_DIR / "paged_attention.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform
        logger.warning("C++ kernels unavailable (%s); using the torch fallback", e)
        return None
