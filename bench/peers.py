"""The peers the CPU benchmarks compare against: llama.cpp's `llama-server`, `llama-bench` and
`llama-quantize`, built from the llama.cpp sources vendored in llama-cpp-python's sdist, plus that
tree's `convert_hf_to_gguf.py` and `gguf-py`.

Where the sources come from: `pip download llama-cpp-python==<version> --no-binary :all: --no-deps`
(the version installed in this interpreter, else `DEFAULT_VERSION`), cached under the peers
directory; nothing else is fetched (the server's web UI download is turned off). The build is
cmake, Release, `-DGGML_NATIVE=ON` (this machine's ISA), `-j <cores>`, only the three targets.
Everything goes under an ignored directory inside the repository:

    .venv/peers/cache/llama_cpp_python-<v>.tar.gz          the sdist
    .venv/peers/llama.cpp-<v>/src/                          its vendor/llama.cpp
    .venv/peers/llama.cpp-<v>/build/bin/llama-{server,bench,quantize}
    .venv/peers/llama.cpp-<v>/build.json                    what was built, how (written last)

A second `build` finds `build.json` and the binaries and does nothing. `$MLASERVE_PEERS_DIR` moves the
peers directory; `$MLASERVE_LLAMA_CPP_BIN` points at another build's `bin/` (used before ours), and
`$MLASERVE_LLAMA_CPP_SRC` at another llama.cpp source tree (for the converter).

Benchmarks call `llama_cpp_bin(name)` and `convert_script()`: None when the peer is absent, and
then they record it as skipped (`absent_reason`) instead of failing. Standard library only, so any
python3 runs it (`make peers` uses the project's venv when there is one):

    python3 bench/peers.py build [--version 0.3.36] [--sdist path.tar.gz] [--jobs N]
    python3 bench/peers.py status        # what is there, as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VERSION = "0.3.36"  # used when llama-cpp-python is not installed in this interpreter
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # deprecated upstream (a warning), kept: older trees need it to build offline
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the server's build tries to download its web UI
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries
)


def peers_dir() -> Path:
    return Path(os.environ.get("MLASERVE_PEERS_DIR") or ROOT / ".venv" / "peers")


def installed_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def llama_cpp_version() -> str:
    """The llama-cpp-python version whose vendored llama.cpp is the peer."""
    return installed_version() or DEFAULT_VERSION


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tree(version: str | None = None) -> Path:
    return peers_dir() / f"llama.cpp-{version or llama_cpp_version()}"


def src_dir(version: str | None = None) -> Path:
    return tree(version) / "src"


def bin_dir(version: str | None = None) -> Path:
    return tree(version) / "build" / "bin"


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def llama_cpp_bin(name: str, version: str | None = None) -> Path | None:
    """Path of a llama.cpp binary (`llama-server`, ...), or None when it has not been built."""
    override = os.environ.get("MLASERVE_LLAMA_CPP_BIN")
    candidates = ([Path(override) / name] if override else []) + [bin_dir(version) / name]
    return next((p for p in candidates if _executable(p)), None)


def _source_root(version: str | None = None) -> Path | None:
    override = os.environ.get("MLASERVE_LLAMA_CPP_SRC")
    for d in ([Path(override)] if override else []) + [src_dir(version)]:
        if (d / "convert_hf_to_gguf.py").is_file():
            return d
    return None


def convert_script(version: str | None = None) -> Path | None:
    """The vendored `convert_hf_to_gguf.py` (it puts its sibling `gguf-py` first on sys.path itself)."""
    root = _source_root(version)
    return root / "convert_hf_to_gguf.py" if root else None


def gguf_py_dir(version: str | None = None) -> Path | None:
    root = _source_root(version)
    return root / "gguf-py" if root and (root / "gguf-py").is_dir() else None


def absent_reason(name: str) -> str:
    """Why a peer is missing, for the JSON results and the console."""
    return (f"{name} not found (looked in $MLASERVE_LLAMA_CPP_BIN and {bin_dir()}); "
            f"build it with `make peers` (about 10+ minutes on 2 cores)")


def binary_version(path: Path) -> str | None:
    """First line of `<binary> --version` (llama.cpp prints 'version: N (commit)' on stderr)."""
    try:
        p = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (p.stderr + p.stdout).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None


# ------------------------------------------------------------------------------- extra buffers
# llama.cpp keeps weights it has faster kernels for in "extra" buffers (AMX tiles, repacked
# interleavings). On a CPU with AMX-INT8, llama.cpp 0.3.36 built natively crashes in its AMX ones
# (a 2-core Xeon VM, 2026-12-04): on SmolLM2 Q4_1 llama-bench segfaults at a 64-token prompt and
# llama-server in the served benchmark's warm-up, llama-bench aborts on a DeepSeek-V2 graph (`GGML_ASSERT(*cur_backend_id != -1)`, q8_0 and
# q4_k_m), llama-cpp-python's wheel segfaults evaluating a 128-token prompt. There the peers run with
# extra buffers off: ggml's plain CPU kernels (x86 repacks no q8_0 or bf16; Q4_0, Q4_K and IQ4_NL lose
# their interleaving too). Elsewhere they keep llama.cpp's default.


def amx_int8_cpu() -> bool:
    """Whether this CPU has AMX-INT8 (Linux: /proc/cpuinfo's flags; False where that is unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def extra_buffers() -> bool:
    """Whether the peers use llama.cpp's extra weight buffers here (see above)."""
    return not amx_int8_cpu()


def llama_bench_args() -> list[str]:
    return [] if extra_buffers() else ["--repack", "0"]


def llama_server_args() -> list[str]:
    return [] if extra_buffers() else ["--no-repack"]


def open_llama(path: str | os.PathLike[str], *, extra_buffers: bool, **kwargs: Any) -> Any:
    """`llama_cpp.Llama(model_path=path, **kwargs)`, its extra buffers on or off (the binding has no
    argument for them, so its default-params function is wrapped while the model loads)."""
    import llama_cpp
    from llama_cpp import llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = extra_buffers
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), **kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


def status() -> dict[str, Any]:
    info: dict[str, Any] = {
        "llama_cpp_python_version": llama_cpp_version(),
        "installed_llama_cpp_python": installed_version(),
        "tree": str(tree()),
        "binaries": {name: str(p) if (p := llama_cpp_bin(name)) else None for name in TARGETS},
        "convert_hf_to_gguf": str(convert_script()) if convert_script() else None,
        "gguf_py": str(gguf_py_dir()) if gguf_py_dir() else None,
    }
    server = llama_cpp_bin("llama-server")
    info["llama_cpp_version"] = binary_version(server) if server else None
    stamp = tree() / "build.json"
    info["build"] = json.loads(stamp.read_text()) if stamp.is_file() else None
    return info


# ------------------------------------------------------------------------------------------ build


def _run(cmd: list[str], log: Path | None = None, **kw: Any) -> None:
    print("+", " ".join(cmd), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, **kw)
        return
    with log.open("a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}")


def fetch_sdist(version: str, sdist: Path | None = None) -> Path:
    """The sdist in the cache: copied from `sdist`, else `pip download`ed (the only network use)."""
    cache = peers_dir() / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    target = cache / name
    if target.is_file():
        return target
    if sdist is not None:
        shutil.copyfile(sdist, target)
        return target
    _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
          "--no-deps", "-d", str(cache)])
    if not target.is_file():
        found = sorted(cache.glob(f"llama_cpp_python-{version}.*"))
        if not found:
            raise SystemExit(f"pip download left no sdist of llama-cpp-python {version} in {cache}")
        return found[0]
    return target


def unpack(sdist: Path, version: str) -> Path:
    """Extracts only `<sdist>/vendor/llama.cpp/` into src/ (idempotent; a half-done unpack is redone)."""
    dest = src_dir(version)
    done = dest / ".unpacked"
    if done.is_file():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    tmp = tree(version) / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prefix = None
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            parts = Path(m.name).parts
            if len(parts) >= 3 and parts[1:3] == ("vendor", "llama.cpp"):
                prefix = Path(*parts[:3])
                members.append(m)
        if not members or prefix is None:
            raise SystemExit(f"{sdist} has no vendor/llama.cpp")
        extract_kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(tmp, members=members, **extract_kw)
    (tmp / prefix).rename(dest)
    shutil.rmtree(tmp)
    done.write_text(str(sdist) + "\n")
    return dest


def cmake_commands(src: Path, build: Path, jobs: int) -> list[list[str]]:
    return [
        ["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS],
        ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TARGETS],
    ]


def is_built(version: str) -> bool:
    return (tree(version) / "build.json").is_file() and all(_executable(bin_dir(version) / t) for t in TARGETS)


def build(version: str | None = None, sdist: Path | None = None, jobs: int | None = None) -> dict[str, Any]:
    """Builds the three binaries once; later calls return what build.json recorded."""
    version = version or llama_cpp_version()
    stamp = tree(version) / "build.json"
    if is_built(version):
        print(f"llama.cpp {version}: already built in {bin_dir(version)}")
        return json.loads(stamp.read_text())
    if shutil.which("cmake") is None:
        raise SystemExit("cmake not found: install cmake (apt-get install cmake) and a C++ compiler")
    tree(version).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    archive = fetch_sdist(version, sdist)
    src = unpack(archive, version)
    log = tree(version) / "build.log"
    log.write_text("")
    commands = cmake_commands(src, tree(version) / "build", jobs or cores())
    for cmd in commands:
        _run(cmd, log)
    missing = [t for t in TARGETS if not _executable(bin_dir(version) / t)]
    if missing:
        raise SystemExit(f"the build finished without {', '.join(missing)}; see {log}")
    info = {
        "llama_cpp_python_version": version, "sdist": str(archive), "source": str(src),
        "commands": commands, "jobs": jobs or cores(), "seconds": round(time.time() - t0, 1),
        "llama_cpp_version": binary_version(bin_dir(version) / "llama-server"),
        "binaries": {t: str(bin_dir(version) / t) for t in TARGETS},
    }
    stamp.write_text(json.dumps(info, indent=2) + "\n")
    print(f"llama.cpp {version}: built {', '.join(TARGETS)} in {info['seconds']:.0f} s into {bin_dir(version)}")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download (once), unpack and build llama.cpp's binaries")
    b.add_argument("--version", default=None,
                   help=f"llama-cpp-python version (default: installed, else {DEFAULT_VERSION})")
    b.add_argument("--sdist", type=Path, default=None, help="use this sdist .tar.gz instead of pip download")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: cores)")
    u = sub.add_parser("unpack", help="download (once) and unpack llama.cpp's sources only: its converter, "
                                      "the oracle of the quantized-checkpoint tests")
    u.add_argument("--version", default=None,
                   help=f"llama-cpp-python version (default: installed, else {DEFAULT_VERSION})")
    sub.add_parser("status", help="print what is built, as JSON")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.version, args.sdist, args.jobs)
    elif args.cmd == "unpack":
        version = args.version or llama_cpp_version()
        print(f"llama.cpp {version}: sources in {unpack(fetch_sdist(version), version)}")
    else:
        print(json.dumps(status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
