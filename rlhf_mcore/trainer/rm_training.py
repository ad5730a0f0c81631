"""Bradley-Terry reward-model training on the train engine (`launch/train_rm.py`).

The model starts from a Hugging Face causal LM (its score head initialised small, see
:class:`rlhf_mcore.models.value_head.ValueHead`) or from a reward model, and is built with `role="reward"`, so
TP / PP / DP, micro-batching, the optimizer and the export are the actor's. Each optimizer step takes
`batch_size` preference pairs (over all DP ranks), each rank its share, chosen and rejected in adjacent rows
(:func:`pair_batch`); the loss is :func:`rlhf_mcore.engine.reward_engine.bradley_terry_loss`.

A sequence is what the RL loop gives a reward model that shares the policy's tokenizer: the prompt through the
chat template with the generation prompt, the response's tokens, then the end-of-turn token
(`<|im_end|>` where the tokenizer has it, else EOS) — so a model trained here scores rollouts in the form it
was trained on. Pairs longer than `max_length` are dropped (counted).

After every epoch the held-out pairwise accuracy (the share of held-out pairs with s_chosen > s_rejected) is
printed and returned; the result is written as a `*ForSequenceClassification` directory transformers loads.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Optional

from rlhf_mcore.data.schema import DataError

__all__ = ["pair_batch", "encode_pairs", "run_train_rm", "pairwise_accuracy"]


def pair_batch(chosen: list[list[int]], rejected: list[list[int]], pad_token_id: int) -> dict:
    """Pairs as adjacent rows (chosen at 2k, rejected at 2k + 1) of the engine's batch layout."""
    from rlhf_mcore.data.batch import sequence_batch

    seqs = [s for pair in zip(chosen, rejected, strict=True) for s in pair]
    return sequence_batch(seqs, pad_token_id)


def end_token_id(tokenizer) -> int:
    """`<|im_end|>` where the tokenizer has it (chat models), else its EOS token."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.eos_token_id if end is None or end == tokenizer.unk_token_id else end


def encode_pairs(rows, tokenizer, max_length: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(chosen ids, rejected ids) per preference row (module docstring); and how many pairs were too long."""
    end = end_token_id(tokenizer)
    pairs, dropped = [], 0
    for messages, chosen, rejected in rows:
        p = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)
        c = p + tokenizer(chosen, add_special_tokens=False)["input_ids"] + [end]
        r = p + tokenizer(rejected, add_special_tokens=False)["input_ids"] + [end]
        if max(len(c), len(r)) > max_length:
            dropped += 1
            continue
        pairs.append((c, r))
    return pairs, dropped


def pairwise_accuracy(engine, state, pairs, pad_token_id: int) -> tuple[float, float]:
    """(share of pairs scored s_chosen > s_rejected, mean margin) on every rank."""
    from rlhf_mcore.rewards.reward_model import score_sequences

    scores = score_sequences(engine, state, [s for pair in pairs for s in pair], pad_token_id)
    margins = [scores[2 * i] - scores[2 * i + 1] for i in range(len(pairs))]
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def run_train_rm(model: str, train_file: str, out: str, *, val_file: Optional[str] = None, val_fraction: float = 0.1,
                 epochs: int = 1, batch_size: int = 32, micro_batch_pairs: int = 4, lr: float = 1e-5,
                 max_length: int = 512, tp: int = 1, pp: int = 1, seed: int = 1, warmup_steps: int = 0,
                 device: str = "auto", log_every: int = 10) -> dict:
    """Train, evaluate each epoch, export to `out`. Returns {"val_accuracy": [per epoch], "val_margin": [...],
    "train": last step's metrics, "num_train_pairs", "num_val_pairs", "dropped_too_long"}."""
    from transformers import AutoTokenizer

    from rlhf_mcore.config import ConfigError, OptimConfig
    from rlhf_mcore.config.hf import model_is_moe
    from rlhf_mcore.data.preferences import read_preference_rows
    from rlhf_mcore.engine.config import EngineConfig
    from rlhf_mcore.engine.reward_engine import RewardEngine
    from rlhf_mcore.models import build_model
    from rlhf_mcore.parallel import destroy_distributed, init_distributed
    from rlhf_mcore.trainer.logging import reduce_metrics
    from rlhf_mcore.trainer.run_lock import take_run_lock

    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model!r} is not a Hugging Face model directory (no config.json)")
    if tp > 1 and model_is_moe(model):  # megatron-core's own error would come at the first training step
        raise ConfigError(f"--tp {tp}: {model} is a mixture-of-experts model, and megatron-core 0.16.1's MoE layer "
                          "refuses a training forward at TP > 1 without sequence parallelism (which needs Transformer "
                          "Engine; the reward-model trainer does not turn it on): use --tp 1")
    if not 0 < val_fraction < 1 and val_file is None:
        raise ConfigError(f"--val-fraction {val_fraction} must be in (0, 1) when no --val-file is given")
    tok = AutoTokenizer.from_pretrained(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train_pairs, dropped = encode_pairs(read_preference_rows(train_file), tok, max_length)
    if val_file is not None:
        val_pairs, d2 = encode_pairs(read_preference_rows(val_file), tok, max_length)
        dropped += d2
    else:
        order = list(range(len(train_pairs)))
        random.Random(seed).shuffle(order)
        n_val = max(1, int(len(order) * val_fraction))
        val_pairs = [train_pairs[i] for i in order[:n_val]]
        train_pairs = [train_pairs[i] for i in order[n_val:]]
    if len(train_pairs) < batch_size or not val_pairs:
        raise DataError(f"{len(train_pairs)} training pairs (after a held-out split of {len(val_pairs)} and "
                        f"{dropped} over --max-length {max_length}) are fewer than --batch-size {batch_size}")
    steps_per_epoch = len(train_pairs) // batch_size
    total = steps_per_epoch * epochs
    state = init_distributed(tp, pp, device=device, seed=seed)
    lock = take_run_lock(out, state, key="--out")
    try:
        dp = state.dims.dp
        if batch_size % dp or (batch_size // dp) % micro_batch_pairs:
            raise ConfigError(f"--batch-size {batch_size} pairs must split into DP={dp} equal shares of whole "
                              f"micro-batches of --micro-batch-pairs {micro_batch_pairs}")
        chunks = build_model(model, state, role="reward")
        optim = OptimConfig(lr=lr, lr_scheduler="cosine", lr_warmup_steps=warmup_steps, weight_decay=0.0,
                            total_training_steps=total)
        engine = RewardEngine(chunks, state, EngineConfig(role="reward", micro_batch_size=2 * micro_batch_pairs,
                                                          seed=seed), optim)
        history: dict = {"val_accuracy": [], "val_margin": [], "num_train_pairs": len(train_pairs),
                         "num_val_pairs": len(val_pairs), "dropped_too_long": dropped}
        per_rank, t0, step, last = batch_size // dp, time.time(), 0, {}
        rng = random.Random(seed)
        for epoch in range(1, epochs + 1):
            order = list(range(len(train_pairs)))
            rng.shuffle(order)  # the same on every rank
            for k in range(steps_per_epoch):
                step_ids = order[k * batch_size:(k + 1) * batch_size]
                ids = step_ids[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]
                batch = pair_batch([train_pairs[i][0] for i in ids], [train_pairs[i][1] for i in ids], pad)
                last = reduce_metrics(engine.update(batch))
                step += 1
                if state.is_coordinator and (step % log_every == 0 or step == total):
                    print(f"rm step {step}/{total} | loss {last['reward/bt_loss']:.4f} | acc "
                          f"{last['reward/accuracy']:.3f} | lr {last['reward/lr']:.2e} | {time.time() - t0:.0f}s",
                          flush=True)
            acc, margin = pairwise_accuracy(engine, state, val_pairs, pad)
            history["val_accuracy"].append(acc)
            history["val_margin"].append(margin)
            if state.is_coordinator:
                print(f"epoch {epoch}/{epochs}: held-out pairwise accuracy {acc:.3f} ({len(val_pairs)} pairs), "
                      f"mean margin {margin:.3f}", flush=True)
        history["train"] = last
        engine.save_hf(out)
        if state.is_coordinator:
            print(f"reward model (Hugging Face *ForSequenceClassification): {out}", flush=True)
        return history
    finally:
        destroy_distributed()
        lock.release()
