"""Build of the native extension `cpp_experts._C` (everything else is declared in pyproject.toml).

One binary for every x86-64 CPU: the AVX2, AVX-512 and AMX kernels carry per-function target attributes
and are chosen at run time from CPUID, so no -march flag is ever passed here. Elsewhere (aarch64) the
same sources build with the portable kernels alone (cpp_experts/csrc/cpu.h: CPX_X86).
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# the sources compile in parallel, one job per CPU (NPY_NUM_BUILD_JOBS=N sets the count, pybind11's
# convention): setuptools alone compiles one extension's files one after another
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

ext = Pybind11Extension(
    "cpp_experts._C",
    sorted(glob("cpp_experts/csrc/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3"],
    depends=sorted(glob("cpp_experts/csrc/*.h")),
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
