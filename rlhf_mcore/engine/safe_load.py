"""Load a Megatron distributed checkpoint without running code from it: tensors and plain data only.

megatron-core's `torch_dist` loader reads four kinds of file, and two of them with pickle: `metadata.json` (JSON),
`common.pt` (`torch.load`), `.metadata` (torch's distributed-checkpoint index, a plain `pickle.load`) and the
`.distcp` shards, whose tensors torch reads with `weights_only=True` but whose non-tensor ("bytes") items, Megatron's
ShardedObjects (the RNG states), it unpickles with `torch.load(weights_only=False)`: a pickle planted there runs.
:func:`load_distributed` instead

- unpickles `.metadata` allowing only the index's own classes (:func:`read_metadata`)
  and refuses a bytes item at a key that is not a ShardedObject's, so no requested tensor is read as bytes;
- loads `common.pt` with `weights_only=True` (stated, whatever torch's default);
- leaves the ShardedObjects out of what Megatron loads and reads each itself, from the byte range of the shard file
  the index names, with `torch.load(weights_only=True)`; numpy arrays are allowed there (no other class), for the
  RNG states of checkpoints written before those were stored as tensors.

A forged or damaged file fails with one line naming it (:class:`CheckpointLoadError`); nothing in it is called.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from rlhf_mcore.errors import UserError

__all__ = ["CheckpointLoadError", "load_distributed", "load_common", "tensor_keys", "read_object", "load_plain",
           "read_metadata"]

_OBJECT_KEY = re.compile(r"/shard_[0-9.]*_[0-9.]*$")  # ShardedObject.unique_key: '<key>/shard_<offset>_<shape>'


class CheckpointLoadError(UserError):
    """A checkpoint file holds something other than tensors and plain data (forged or damaged)."""


def _one_line(e: BaseException) -> str:
    """The reason in one line; of torch's weights-only refusal only the reason (not its advice to load unsafely)."""
    text = " ".join(str(e).split())
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split(" Check the documentation")[0].strip()
        text = text.split(". ")[0]
    return f"{type(e).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _refuse(file: Path, e: BaseException | str) -> CheckpointLoadError:
    why = e if isinstance(e, str) else _one_line(e)
    return CheckpointLoadError(f"checkpoint file {file} holds more than tensors and plain data, so it was not "
                               f"loaded ({why}); it is forged or damaged: resume from another checkpoint")


def _numpy_arrays() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(data: bytes | io.BytesIO, file: Path) -> Any:
    """`torch.load` of tensors, containers, numbers, strings (and numpy arrays), nothing else; CheckpointLoadError
    naming `file` otherwise."""
    buf = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with torch.serialization.safe_globals(_numpy_arrays()):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses every other class; any failure: the item is not usable
        raise _refuse(file, e) from None


def load_common(path: str | Path) -> dict:
    """The checkpoint's `common.pt` (optimizer param groups, scheduler, plain entries), tensors and plain data only."""
    file = Path(path) / "common.pt"
    if not file.is_file():
        raise CheckpointLoadError(f"{path} has no common.pt: not a complete Megatron distributed checkpoint")
    return load_plain(file.read_bytes(), file)


def _check_json(file: Path) -> None:
    try:
        json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise _refuse(file, e) from None


# The classes torch's distributed checkpoint (as Megatron's torch_dist backend writes it) puts into `.metadata`.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_DCP_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
              ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and name != "Size":
            import torch

            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif (module, name) in _DCP_NAMES or (module in _DCP_MODULES and not name.startswith("__")):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or (module, name) == ("torch.serialization", "_get_layout"):
                return obj
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's metadata never holds")


def read_metadata(path: Path):
    """A torch distributed-checkpoint ``.metadata`` unpickled allowing only the metadata classes (and torch dtypes,
    sizes, layouts): nothing outside that list is imported or called. Raises on anything else (UnpicklingError)
    and when the file does not hold a ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta = _MetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    if not isinstance(meta, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(meta).__name__}, not a checkpoint Metadata")
    return meta


def _index(path: Path):
    _check_json(path / "metadata.json")  # Megatron reads it first (the backend's name)
    file = path / ".metadata"
    try:
        meta = read_metadata(file)
    except Exception as e:  # the restricted unpickler's refusal, or a damaged file
        raise _refuse(file, e) from None
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) and not _OBJECT_KEY.search(key):
            raise _refuse(file, f"the tensor {key!r} is declared a pickled object")
    return meta


def tensor_keys(path: str | Path) -> set[str]:
    """The keys of the tensors in the checkpoint at `path` (its `.metadata`, read safely)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k for k, md in _index(Path(path)).state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def read_object(path: str | Path, key: str, meta=None) -> Any:
    """The ShardedObject stored under `key` (its `unique_key`) in the checkpoint at `path`, tensors and plain data
    only; `meta`: the checkpoint's index, if already read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = Path(path)
    meta = _index(path) if meta is None else meta
    if not isinstance(meta.state_dict_metadata.get(key), BytesStorageMetadata):
        raise CheckpointLoadError(f"{path / '.metadata'} has no item {key!r}; the checkpoint was written by another "
                                  "program or layout")
    info = meta.storage_data.get(MetadataIndex(key))
    if info is None:
        raise _refuse(path / ".metadata", f"item {key!r} has no storage entry")
    file = (path / info.relative_path).resolve()
    if file.parent != path.resolve() or getattr(info, "transform_descriptors", None):
        raise _refuse(path / ".metadata", f"item {key!r} points at {info.relative_path!r} with transforms "
                                          f"{getattr(info, 'transform_descriptors', None)}")
    with open(file, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    items = load_plain(data, file)  # Megatron stores the list of this key's objects on the rank: one
    if not isinstance(items, list) or len(items) != 1:
        raise _refuse(file, f"item {key!r} is not a one-object list")
    return items[0]


def load_distributed(sharded_state_dict: dict, path: str | Path) -> dict:
    """`megatron.core.dist_checkpointing.load` of `sharded_state_dict` from `path`, executing nothing from the files
    (module docstring). A collective, like Megatron's."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    class PlainCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return load_common(checkpoint_dir)

    path = Path(path)
    meta = _index(path)
    objects, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedObject))
    try:
        loaded = dist_checkpointing.load(rest, str(path), common_strategy=PlainCommon())
    except (Exception, CheckpointException) as e:  # torch reads tensors with weights_only=True: a pickle fails there
        if "weights only" not in str(e).lower() and "weights_only" not in str(e):
            raise
        raise _refuse(path / "__*.distcp", e) from None
    merge(loaded, dict_list_map_inplace(lambda o: read_object(path, o.unique_key, meta), objects))
    return loaded
