"""The train engine: Megatron-Core model chunks driven by RL batches.

- :mod:`.train_engine` — :class:`TrainEngine` (actor / critic / frozen reference): log-probs, values, PPO updates,
  offload/onload, checkpoints; :mod:`.builder` — :func:`build_engine` from the run configuration;
- :mod:`.config` — :class:`EngineConfig` (batching, loss and scoring settings);
- :mod:`.logprobs` — the log-prob/entropy backends by name (torch reference, Triton kernel: rlhf_mcore.kernels);
- :mod:`.packing` — padded batch -> packed THD or padded model inputs, and outputs back to `[B, R]`;
- :mod:`.micro_batches` — mini/micro-batches by sequence count or token budget;
- :mod:`.balance` — Karmarkar-Karp / greedy partitioning of sequences by token count (DP balancing too);
- :mod:`.losses` — micro-batch actor/critic losses with mini-batch-global normalisation;
- :mod:`.optim` — DDP wrapping, optimizer, LR schedule; :mod:`.offload`; :mod:`.checkpoint`;
- :mod:`.flops` — the FLOP model behind tokens/s and MFU.
"""
from rlhf_mcore.engine.balance import greedy_partition, karmarkar_karp, partition_balanced, split_by_token_budget
from rlhf_mcore.engine.builder import build_engine
from rlhf_mcore.engine.config import EngineConfig
from rlhf_mcore.engine.flops import FlopShape, forward_flops, mfu, peak_flops, train_flops
from rlhf_mcore.engine.logprobs import get_logprob_backend, register_logprob_backend
from rlhf_mcore.engine.packing import ModelInputs, build_model_inputs
from rlhf_mcore.engine.train_engine import TrainEngine

__all__ = [
    "TrainEngine", "EngineConfig", "build_engine", "get_logprob_backend",
    "register_logprob_backend", "ModelInputs", "build_model_inputs", "karmarkar_karp", "greedy_partition",
    "partition_balanced", "split_by_token_budget", "FlopShape", "train_flops", "forward_flops", "peak_flops", "mfu",
]
