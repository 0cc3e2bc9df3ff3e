"""Which files of an HF model directory hold its weights: torch-free, so that the server can check a
directory before it binds its port (`server.args.model_problem`) as the loader will read it."""

from __future__ import annotations

from pathlib import Path

from models.loader.errors import CheckpointError
from models.loader.jsonfile import read_json

INDEX_FILE = "model.safetensors.index.json"


def find_shards(path: Path) -> dict[Path, list[str] | None]:
    """Shard file -> tensor names the index promises in it (None: no index, take what is there)."""
    index_path = path / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "key 'weight_map' must be a non-empty object of tensor -> file")
        shards: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(index_path, f"weight_map['{name}'] must be a file name, got {file!r}")
            if not file or Path(file).is_absolute() or ".." in Path(file).parts:
                raise CheckpointError(index_path, f"weight_map['{name}'] points outside the model directory: {file!r}")
            shard = path / file  # (may link anywhere: a Hugging Face cache's shards link to its blobs/)
            if not shard.is_file():
                raise CheckpointError(index_path, f"weight_map['{name}'] names shard '{file}', which is missing")
            names = shards.setdefault(shard, [])
            assert names is not None
            names.append(name)
        return shards
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        if not f.is_file():  # a FIFO or device would block the reader forever
            raise CheckpointError(f, "is not a regular file")
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded; convert them to safetensors)" if pickled else ""
        raise CheckpointError(path, f"no *.safetensors weight files{hint}")
    return {f: None for f in files}
