"""Build of the extensions with torch.utils.cpp_extension: fsd_ext._C (the FSD ops) and
fsd_ext.cpu_linear._C (the CPU linear kernels of decoding, a component the FSD ops do not use).

The CPU kernels are always built. The CUDA kernels (csrc/fsd/cuda/*.cu, csrc/torch/*_cuda.cpp) are
added when a CUDA toolkit and a CUDA build of torch are both present; FSD_EXT_CUDA=0/1 overrides.
TORCH_CUDA_ARCH_LIST overrides the default targets (sm_80, sm_90). FSD_EXT_SANITIZE=1 builds the
CPU code with AddressSanitizer and UndefinedBehaviorSanitizer (for CI's sanitizer job).
Build after installing torch: `pip install --no-build-isolation .`
"""

import glob
import os
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda() -> bool:
    flag = os.environ.get("FSD_EXT_CUDA", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def compile_flags():
    """-> (C++ flags, link flags) of both extensions."""
    cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd", "-Wall", "-Wno-unknown-pragmas"]
    link_flags = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is inline: without OpenMP in *this* build it runs every range on one
        # thread. libgomp resolves to the copy torch has already loaded (same soname).
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    if os.environ.get("FSD_EXT_SANITIZE") == "1":
        # FSD_NO_CLONES: no x86 target_clones (ifunc resolvers run before ASan is initialised).
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                    "-fno-omit-frame-pointer", "-O1", "-g", "-DFSD_NO_CLONES"]
        cxx_flags += sanitize
        link_flags += ["-fsanitize=address,undefined"]
    return cxx_flags, link_flags


INCLUDE_DIRS = [os.path.join(ROOT, "csrc")]


def fsd_extension():
    cpu_sources = rel("csrc/fsd/cpu/*.cpp") + rel("csrc/torch/*.cpp")
    cuda_sources = rel("csrc/fsd/cuda/*.cu")  # the torch side of CUDA is csrc/torch/*_cuda.cpp
    cxx_flags, link_flags = compile_flags()
    include_dirs = INCLUDE_DIRS
    if want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
        return cpp_extension.CUDAExtension(
            "fsd_ext._C", cpu_sources + cuda_sources,
            include_dirs=include_dirs, define_macros=[("FSD_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags)
    cpu_only = [s for s in cpu_sources if not s.endswith("_cuda.cpp")]
    return cpp_extension.CppExtension(
        "fsd_ext._C", cpu_only, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)


def cpu_linear_extension():
    cxx_flags, link_flags = compile_flags()
    return cpp_extension.CppExtension(
        "fsd_ext.cpu_linear._C", rel("csrc/cpu_linear/*.cpp"), include_dirs=INCLUDE_DIRS,
        extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)


setup(
    ext_modules=[fsd_extension(), cpu_linear_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
