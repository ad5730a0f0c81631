"""Rollout (generation) engines behind one protocol, chosen by name.

    engine = build_rollout_engine("native", "/path/to/hf_model", max_num_seqs=256)
    outs = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=512))

"native" (default) is this project's own engine (`rollout/native/`); "hf" wraps transformers' `generate`
(the correctness and speed reference); "sglang" drives an in-process SGLang engine (needs sglang installed).
"""

from __future__ import annotations

from .base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Finished,
    GenerationOutput,
    Request,
    RolloutEngine,
    Sample,
    SamplingParams,
)

ENGINES = ("native", "hf", "sglang")


def build_rollout_engine(name: str, model_dir, **cfg) -> RolloutEngine:
    """Build the rollout engine `name` ("native" | "hf" | "sglang") for the HF model directory `model_dir`.

    Keyword arguments go to the backend's constructor (e.g. `max_num_seqs`, `max_model_len`, `device`,
    `dtype` for native; `tp_size`, `gpu_memory_utilization`, `tp_group` for sglang).
    """
    if name == "native":
        from .native.engine import NativeRolloutEngine

        return NativeRolloutEngine(model_dir, **cfg)
    if name == "hf":
        from .hf_backend import HFRolloutEngine

        return HFRolloutEngine(model_dir, **cfg)
    if name == "sglang":
        from .sglang_backend import SGLangRolloutEngine

        return SGLangRolloutEngine(model_dir, **cfg)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINES} "
                     "(config key: actor_rollout_ref.rollout.name).")


__all__ = ["ENGINES", "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "Finished", "GenerationOutput", "Request",
           "RolloutEngine", "Sample", "SamplingParams", "build_rollout_engine"]
