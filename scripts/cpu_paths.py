"""Print the environment that forces the AVX2 ("Haswell") code paths of every math library the
kernel uses, for a second run of the kernel exactness tests (`./dev.sh test` runs it).

    eval "$(python scripts/cpu_paths.py)"   # sets the variables, or prints why it cannot

- OpenBLAS (numpy's BLAS): OPENBLAS_CORETYPE=Haswell (AVX2 + FMA kernels). Where the environment
  already sets OPENBLAS_CORETYPE (some machines need a specific core type for correct results), it
  is kept as it is and said so.
- numpy's own SIMD loops: NPY_DISABLE_CPU_FEATURES lists the AVX-512 feature groups numpy found on
  this CPU (numpy refuses names it did not find, so the list is read from numpy itself).
- torch: ATEN_CPU_CAPABILITY=avx2 (ATen's vectorised kernels), ONEDNN_MAX_CPU_ISA=AVX2 and
  MKL_ENABLE_INSTRUCTIONS=AVX2 (its GEMMs).
Only on x86-64 with AVX2; elsewhere it prints a comment and sets nothing.
"""

from __future__ import annotations

import os
import platform
import shlex


def _features() -> dict[str, bool]:
    try:
        from numpy._core._multiarray_umath import __cpu_features__  # numpy >= 2
    except ImportError:
        from numpy.core._multiarray_umath import __cpu_features__  # numpy 1.26
    return dict(__cpu_features__)


def _numpy_avx512(feats: dict[str, bool]) -> list[str]:
    return sorted(f for f, on in feats.items() if on and (f.startswith("AVX512") or f == "X86_V4"))


def main() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"# not x86-64 ({platform.machine()}): no AVX2 paths to force")
        return
    feats = _features()
    if not feats.get("AVX2"):
        print("# this CPU has no AVX2: nothing to force")
        return
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    if os.environ.get("OPENBLAS_CORETYPE"):
        print(f"# OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} is set by this machine: kept")
    else:
        env["OPENBLAS_CORETYPE"] = "Haswell"
    off = _numpy_avx512(feats)
    if off:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(off)
    print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))


if __name__ == "__main__":
    main()
