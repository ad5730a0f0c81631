"""Data: raw GSM8K/MATH -> parquet in veRL's schema, the synthetic arithmetic task, prompt loading, and the records
and batches every trainer path passes.

- :mod:`.schema` — the row format (`make_row`, `check_row`);
- :mod:`.preprocess` — `preprocess_gsm8k`, `preprocess_math` (jsonl/parquet in, `train/test.parquet` out);
- :mod:`.boxed` — the last `\\boxed{...}` of a text (MATH ground truths and answers);
- :mod:`.synthetic` — `make_synthetic_rows`, `write_synthetic_parquet` (`synthetic/arithmetic`);
- :mod:`.rl_dataset` — `RLDataset` (chat template, length policy, malformed-row policy);
- :mod:`.collate` — `LeftPadCollator` (left padding to `[B, T]`);
- :mod:`.sampler` — `ResumableSampler` (deterministic order, mid-epoch resume);
- :mod:`.seeds` — `step_seed`, the rollout seed of a training step;
- :mod:`.rows` — `Row`, one generated sample with its reward;
- :mod:`.batch` — `build_batch` (rows -> the padded batch every phase works on), `sequence_batch`.

`raw/` holds the vendored GSM8K. Importing this package imports none of its modules (nor numpy, pyarrow or torch):
each name below is loaded on first use, so light modules (`rewards`' MATH reward reads :mod:`.boxed`) stay light.
"""
_LAZY = {
    "preprocess_gsm8k": "rlhf_mcore.data.preprocess",
    "preprocess_math": "rlhf_mcore.data.preprocess",
    "RLDataset": "rlhf_mcore.data.rl_dataset",
    "ResumableSampler": "rlhf_mcore.data.sampler",
    "BadRowError": "rlhf_mcore.data.schema",
    "DataError": "rlhf_mcore.data.schema",
    "check_row": "rlhf_mcore.data.schema",
    "make_row": "rlhf_mcore.data.schema",
    "make_synthetic_rows": "rlhf_mcore.data.synthetic",
    "write_synthetic_parquet": "rlhf_mcore.data.synthetic",
    "LeftPadCollator": "rlhf_mcore.data.collate",
}

__all__ = list(_LAZY)


def __getattr__(name: str):  # PEP 562
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
