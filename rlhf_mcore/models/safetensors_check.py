"""Cheap integrity checks of a model's safetensors files, so a damaged download fails with its file name.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and `data_offsets` [begin, end) into the data that follows, then the data. Reading only the header
tells whether the file is complete: the largest end offset must equal the file's size after the header, and
each tensor's byte range must match its dtype and shape. Every rank runs the check on every file before reading
any weight, so a truncated shard stops all ranks at the same point instead of one rank raising while the
others wait in a collective.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from rlhf_mcore.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
_FIX = "re-download the model, or re-save it with transformers' save_pretrained"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


class ModelFileError(UserError, ValueError):
    """A model file that is missing, truncated or not in the format its name says; the message names it."""


def check_safetensors_file(path) -> None:
    """Raise ModelFileError naming `path` when its header is unreadable or disagrees with the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(n) if n is not None and 0 < n <= min(_MAX_HEADER, size - 8) else None
    except OSError as e:
        raise ModelFileError(f"cannot read model file {path}: {e.strerror or e}; {_FIX}.") from None
    if raw is None:
        raise ModelFileError(f"model file {path} ({size} bytes) is not a safetensors file: its header length "
                             f"{n if n is not None else '(missing)'} does not fit the file; it is truncated or "
                             f"corrupt: {_FIX}.")
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = 0
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, stop = (int(x) for x in entry["data_offsets"])
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
            width = _DTYPE_BYTES.get(entry["dtype"])
            if stop < begin or (width is not None and stop - begin != numel * width):
                raise ValueError(f"tensor {name!r} has data_offsets [{begin}, {stop}) for a {entry['dtype']} "
                                 f"tensor of shape {entry['shape']}")
            end = max(end, stop)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"model file {path} has a corrupt safetensors header ({e}): {_FIX}.") from None
    data = size - 8 - n
    if end != data:
        what = "truncated" if end > data else "longer than its header says"
        raise ModelFileError(f"model file {path} is {what}: its header lists {end} bytes of tensor data but the "
                             f"file holds {data}; {_FIX}.")


def model_weight_files(model_dir) -> list[Path]:
    """The safetensors files of an HF model directory (those its index lists, else every *.safetensors), each
    checked with `check_safetensors_file`. An empty list when the directory has none."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFileError(f"model index {index} is not a safetensors index ({type(e).__name__}: {e}): "
                                 f"{_FIX}.") from None
        files = [model_dir / name for name in names]
        for f in files:
            if not f.is_file():
                raise ModelFileError(f"model file {f} is listed in {index} but missing: {_FIX}.")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        check_safetensors_file(f)
    return files
