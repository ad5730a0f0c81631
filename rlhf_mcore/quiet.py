"""Known-harmless third-party warnings and progress bars, silenced once at the entry points.

Each filter names the exact message and the module that emits it, so any other warning still shows. Called by
:func:`rlhf_mcore.cli.report_user_errors` (every launch script) and by `init_distributed`.
"""
from __future__ import annotations

import os
import sys
import warnings

# (category, message regex, emitting module regex, why it is harmless)
KNOWN_HARMLESS = (
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\.",
     "without TE/Apex megatron runs its torch implementations, which is what this project tests and uses"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.",
     "the same: torch's RMSNorm/LayerNorm"),
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config",
     "megatron's own default cuda_graph_scope; no CUDA graph of megatron's is used"),
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated",
     r"torch\.distributed",
     "megatron's DDP calls torch's older collective names, which still do the same thing"),
)


def silence_known_warnings() -> None:
    for category, message, module, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    # `datasets` draws a progress bar for every file it converts ("Generating train split ..."). It reads this
    # variable when it is first imported (a user's explicit value wins, as it would over disable_progress_bar());
    # importing it here would cost ~1 s in commands that never read a dataset (--print-config).
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
