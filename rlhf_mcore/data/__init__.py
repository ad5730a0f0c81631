"""Data: raw GSM8K/MATH -> parquet in veRL's schema, the synthetic arithmetic task, and prompt loading.

- :mod:`.schema` — the row format (`make_row`, `check_row`);
- :mod:`.preprocess` — `preprocess_gsm8k`, `preprocess_math` (jsonl/parquet in, `train/test.parquet` out);
- :mod:`.synthetic` — `make_synthetic_rows`, `write_synthetic_parquet` (`synthetic/arithmetic`);
- :mod:`.rl_dataset` — `RLDataset` (chat template, length policy, malformed-row policy);
- :mod:`.collate` — `LeftPadCollator` (left padding to `[B, T]`);
- :mod:`.sampler` — `ResumableSampler` (deterministic order, mid-epoch resume).

`raw/` holds the vendored GSM8K. Importing this package does not import torch (the collator does, lazily).
"""
from rlhf_mcore.data.preprocess import preprocess_gsm8k, preprocess_math
from rlhf_mcore.data.rl_dataset import RLDataset
from rlhf_mcore.data.sampler import ResumableSampler
from rlhf_mcore.data.schema import BadRowError, DataError, check_row, make_row
from rlhf_mcore.data.synthetic import make_synthetic_rows, write_synthetic_parquet

__all__ = [
    "preprocess_gsm8k",
    "preprocess_math",
    "RLDataset",
    "ResumableSampler",
    "BadRowError",
    "DataError",
    "check_row",
    "make_row",
    "make_synthetic_rows",
    "write_synthetic_parquet",
    "LeftPadCollator",
]


def __getattr__(name: str):
    if name == "LeftPadCollator":  # imports torch; keep `import rlhf_mcore.data` light for the CLI
        from rlhf_mcore.data.collate import LeftPadCollator

        return LeftPadCollator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
