"""A checkpoint's manifest: the size and SHA-256 of every file, checked before anything reads the files.

``MANIFEST.json`` lists every file under the checkpoint directory (relative POSIX path -> size, sha256); the
``COMPLETE`` marker, written after it, carries the manifest's own SHA-256, so a manifest edited after the save
no longer matches its marker. :func:`verify_checkpoint` checks, cheapest first: the marker, the manifest, the
set of files (a missing or an extra file, a symlink), every size, every SHA-256, and last that torch's
distributed-checkpoint ``.metadata`` pickles name only the checkpoint-metadata classes torch writes there
(:func:`check_metadata_pickle`; it is unpickled by torch with plain ``pickle`` on load).

Cost: hashing reads every byte once, in 1 MiB chunks, on one rank; for a checkpoint of several GB that is
seconds to minutes of disk reads at save and again at resume. Sizes are compared before any hashing, so a
truncated file is found without reading it.

The manifest detects corruption (truncated or partly written files) and files added or changed after the save.
It is not a signature: whoever can rewrite both a file and the manifest and marker can forge it; loading without
unpickling anything but tensors and plain data (:mod:`rlhf_mcore.engine.safe_load`, the trainer state being JSON)
is what keeps such a forgery from running code: it fails to load, with one line naming the file.

Assumes the checkpoint directory is on a filesystem every rank sees (the one the trainer's rename into place
already needs): rank 0 hashes the files all ranks wrote, after a barrier.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """(files, symlinks) under root as sorted relative POSIX paths; the manifest and marker left out."""
    files, links = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                links.append(rel)
            elif name in filenames and rel not in (MANIFEST, COMPLETE):
                files.append(rel)
    return sorted(files), sorted(links)


def write_manifest(root: str | os.PathLike, step: int) -> None:
    """Hash every file under root into ``MANIFEST.json``, then write ``COMPLETE`` naming the manifest's hash."""
    root = Path(root)
    files, links = _walk(root)
    if links:
        raise ValueError(f"checkpoint {root} holds symlinks ({', '.join(links)}); save real files only")
    entries = {rel: {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)} for rel in files}
    data = (json.dumps({"version": 1, "step": step, "files": entries}, indent=1, sort_keys=True) + "\n").encode()
    (root / MANIFEST).write_bytes(data)
    (root / COMPLETE).write_text(f"step {step}\nmanifest-sha256 {hashlib.sha256(data).hexdigest()}\n")


def verify_checkpoint(root: str | os.PathLike) -> Optional[str]:
    """None if the checkpoint at root is complete and intact, else the first problem found (one line)."""
    root = Path(root)
    marker, manifest = root / COMPLETE, root / MANIFEST
    if not marker.is_file():
        return f"incomplete: no {COMPLETE} marker"
    if not manifest.is_file():
        return f"no {MANIFEST} (written by an older version, or damaged); it cannot be checked"
    data = manifest.read_bytes()
    want = dict(line.split(" ", 1) for line in marker.read_text().splitlines() if " " in line).get("manifest-sha256")
    if want is None or hashlib.sha256(data).hexdigest() != want.strip():
        return f"{MANIFEST} does not match the hash in {COMPLETE} (edited or damaged)"
    try:
        entries = json.loads(data)["files"]
        sizes = {rel: int(e["size"]) for rel, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is malformed ({type(e).__name__}: {e})"
    files, links = _walk(root)
    if links:
        return f"unexpected symlink {links[0]}"
    for rel in files:
        if rel not in sizes:
            return f"unexpected file {rel} (not in {MANIFEST})"
    for rel, size in sizes.items():
        if rel not in files:
            return f"missing file {rel}"
        got = (root / rel).stat().st_size
        if got != size:
            return f"{rel} has {got} bytes, {MANIFEST} says {size} (truncated or overwritten)"
    for rel in sizes:
        if sha256_file(root / rel) != entries[rel]["sha256"]:
            return f"{rel} does not match its SHA-256 in {MANIFEST} (corrupt or modified)"
    for rel in sizes:
        if rel.rsplit("/", 1)[-1] == ".metadata":
            problem = check_metadata_pickle(root / rel)
            if problem:
                return f"{rel}: {problem}"
    return None


def check_metadata_pickle(path: Path) -> Optional[str]:
    """None when :func:`rlhf_mcore.engine.safe_load.read_metadata` reads `path`, else why not."""
    from rlhf_mcore.engine.safe_load import read_metadata

    try:
        read_metadata(path)
    except Exception as e:  # any failure means torch's own unrestricted unpickling must not see the file
        return f"not a plain checkpoint-metadata pickle ({type(e).__name__}: {e})"
    return None


__all__ = ["MANIFEST", "COMPLETE", "write_manifest", "verify_checkpoint", "check_metadata_pickle", "sha256_file"]
