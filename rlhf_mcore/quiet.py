"""Known-harmless third-party warnings and progress bars, silenced once at the entry points; one voice per job.

Each filter names the exact message and the module that emits it, so any other warning still shows. Called by
:func:`rlhf_mcore.cli.report_user_errors` (every launch script) and by `init_distributed`.

A run's log says each thing once: under torchrun the ranks other than 0 print only their errors (their warnings and
informational lines are rank 0's again: the same data, the same libraries), and when stderr is not a terminal
(a log redirected to a file, a job scheduler) no library draws a progress bar, whose carriage-return frames would
be glued to every line.
"""
from __future__ import annotations

import logging
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
    # at every resume (the checkpoint's load):
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed", r"megatron\.core\.dist_checkpointing",
     "megatron's torch strategy calls torch DCP's older name for the same load"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"rlhf_mcore\.parallel\.cpu_compat",
     "megatron's sharded state dicts build torch's ShardedTensor (on CPU through cpu_compat), which torch plans "
     "to replace; the load is the same"),
)


def silence_known_warnings() -> None:
    for category, message, module, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if int(os.environ.get("RANK", "0")) != 0:
        quiet_other_rank()
    if not sys.stderr.isatty():
        no_progress_bars()
    # `datasets` draws a progress bar for every file it converts ("Generating train split ..."). It reads this
    # variable when it is first imported (a user's explicit value wins, as it would over disable_progress_bar());
    # importing it here would cost ~1 s in commands that never read a dataset (--print-config).
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def quiet_other_rank() -> None:
    """A rank other than 0: its own errors only (warnings off; Python logging and transformers' at ERROR)."""
    warnings.simplefilter("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def no_progress_bars() -> None:
    """No Hugging Face progress bars (transformers' "Loading weights", the hub's downloads): stderr is a file."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is first imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
