"""HF checkpoint directories: config.json + memory-mapped *.safetensors (single or sharded).

Never unpickles: `.bin`/`.pt` checkpoints are refused with a hint to convert them. The shard index
is treated as untrusted: every file it names must sit inside the directory, and every tensor it maps
must really be in that shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from models.loader.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, "file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"not valid JSON: {e}") from None


class HFCheckpoint:
    """An HF model directory, opened lazily; tensors are read shard by shard."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(self.path, "not a directory (expected an HF model directory with config.json)")
        self._config = read_json(self.path / "config.json")
        if not isinstance(self._config, dict):
            raise CheckpointError(self.path / "config.json", "must hold a JSON object")
        self._shards = self._find_shards()

    def hf_config(self) -> dict[str, Any]:
        return dict(self._config)

    def _find_shards(self) -> dict[Path, list[str] | None]:
        """Shard file -> tensor names the index promises in it (None: no index, take what is there)."""
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(index_path, "key 'weight_map' must be a non-empty object of tensor -> file")
            shards: dict[Path, list[str] | None] = {}
            root = self.path.resolve()
            for name, file in weight_map.items():
                if not isinstance(file, str):
                    raise CheckpointError(index_path, f"weight_map['{name}'] must be a file name, got {file!r}")
                shard = (self.path / file).resolve()
                if root not in shard.parents:
                    raise CheckpointError(index_path, f"weight_map['{name}'] points outside the model directory: {file!r}")
                if not shard.is_file():
                    raise CheckpointError(index_path, f"weight_map['{name}'] names shard '{file}', which is missing")
                names = shards.setdefault(shard, [])
                assert names is not None
                names.append(name)
            return shards
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded; convert them to safetensors)" if pickled else ""
            raise CheckpointError(self.path, f"no *.safetensors weight files{hint}")
        return {f: None for f in files}

    def _open(self, shard: Path):
        try:
            return safe_open(str(shard), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers/offsets
            raise CheckpointError(shard, f"not a valid safetensors file (truncated or corrupt?): {e}") from None

    def num_tensors(self) -> int:
        total = 0
        for shard, names in self._shards.items():
            if names is None:
                with self._open(shard) as f:
                    total += len(list(f.keys()))
            else:
                total += len(names)
        return total

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        for shard, promised in self._shards.items():
            with self._open(shard) as f:
                keys = list(f.keys())
                if promised is not None:
                    absent = sorted(set(promised) - set(keys))
                    if absent:
                        raise CheckpointError(shard, f"tensor '{absent[0]}' is listed in {INDEX_FILE} but not in this shard")
                for name in keys if promised is None else promised:
                    if name in seen:
                        raise CheckpointError(shard, f"tensor '{name}' appears in more than one shard")
                    seen.add(name)
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise CheckpointError(shard, f"tensor '{name}' cannot be read: {e}") from None
                    yield name, tensor
