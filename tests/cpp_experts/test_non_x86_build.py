"""The extension as a CPU without x86 builds it (aarch64: Graviton, Ampere, Docker on Apple silicon).

There, cpu.h's CPX_X86 is 0: the AVX2, AVX-512 and AMX sources compile to nothing, nothing reads
CPUID, and every operator runs the portable kernels. The suite builds that configuration on this
machine with `-DCPX_X86=0` and runs the operator tests against it (their oracle is the torch
reference, every path but `portable` skipping); where a cross compiler for aarch64 is installed
(`aarch64-linux-gnu-g++`, Debian's g++-aarch64-linux-gnu), it also compiles and links the sources
for aarch64, which catches x86-only code outside the guards that the first build cannot see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "cpp_experts" / "csrc"


@pytest.fixture(scope="module")
def non_x86_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extension built by setup.py with CPX_X86 = 0, into a temporary folder."""
    out = tmp_path_factory.mktemp("non_x86_build")
    env = dict(os.environ, CFLAGS="-DCPX_X86=0", CXXFLAGS="-DCPX_X86=0")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out), "--build-temp",
                        str(out / "obj")], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (lib,) = (out / "cpp_experts").glob("_C*.so")
    return lib


def run_python(lib: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLASERVE_CPP_EXPERTS_LIB=str(lib))
    env.pop("MLASERVE_CPP_EXPERTS_KERNEL", None)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_build_without_x86_paths_offers_the_portable_kernels_alone(non_x86_build: Path) -> None:
    r = run_python(non_x86_build, "-c", "import json, cpp_experts; print(json.dumps(cpp_experts.info()))", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["x86_paths"] is False
    assert info["kernels"] == ["portable"] and info["cpu_flags"] == [] and info["cpu_family"] == 0
    assert set(info["chosen"].values()) == {"portable"}
    assert info["attention_lanes"] == 8


def test_a_build_without_x86_paths_passes_the_operator_tests(non_x86_build: Path) -> None:
    """tests/cpp_experts (this file aside) against that build: each kernel against the torch reference,
    the MoE operator, attention, the worker pool, forcing a missing path."""
    r = run_python(non_x86_build, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cpp_experts",
                   f"--ignore={Path(__file__).relative_to(REPO)}", timeout=1200)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail


def test_the_extension_compiles_and_links_for_aarch64(tmp_path: Path) -> None:
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (Debian: apt-get install g++-aarch64-linux-gnu)")
    import pybind11

    # the host's Python headers: the module is linked, not loaded, and x86-64 and aarch64 are both LP64;
    # -O0: what is checked is that every source compiles and links, and optimising only takes longer
    flags = ["-std=c++17", "-O0", "-fPIC", "-fvisibility=hidden", f"-I{pybind11.get_include()}",
             f"-I{sysconfig.get_paths()['include']}"]

    def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
        obj = tmp_path / (src.stem + ".o")
        return obj, subprocess.run([cxx, *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)

    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        built = list(ex.map(compile_one, sorted(CSRC.glob("*.cpp"))))
    errors = [f"{obj.stem}.cpp:\n{r.stderr[-2000:]}" for obj, r in built if r.returncode != 0]
    assert not errors, "\n".join(errors)
    lib = tmp_path / "_C.so"
    subprocess.run([cxx, "-shared", *[str(obj) for obj, _ in built], "-o", str(lib)], check=True)
    assert int.from_bytes(lib.read_bytes()[18:20], "little") == 0xB7  # ELF e_machine: EM_AARCH64
    nm = shutil.which("aarch64-linux-gnu-nm") or "nm"
    undefined = subprocess.run([nm, "-C", "--undefined-only", str(lib)], capture_output=True, text=True,
                               check=True).stdout
    ours = [line for line in undefined.splitlines() if "cpx::" in line]
    assert not ours, "symbols the aarch64 build references but no source defines:\n" + "\n".join(ours)
