"""Worker for tests/test_async.py: launch/train.py's asynchronous run with an observer on the training pool that
writes every trained row (its token ids, its reward as the batch holds it) and the step's `reward_model/*` metrics.

Usage: torchrun --nproc_per_node=N tests/scripts/async_reward_rows.py --rows OUT.jsonl key=value ...

One line per trained row: {"step", "rank", "ids" (prompt + response, unpadded), "response" (the response ids),
"score" (the sum of the row's `token_level_scores`), "rm_offloaded" (whether the reward model's parameters are off
the device at the step's end)}; one line per step from the coordinator: {"step", "metrics"}. With `--bus DIR [--hold
UID:VERSION]` (fully_async) both sides of the data bus are observed as tests/scripts/async_stream_rows.py does.
"""
import json

from async_observers import Observers, TrainedRows, observe_from_command_line
from worker_common import run_async_trainer

from rlhf_mcore.trainer.hooks import StepHooks


class RowWriter(StepHooks):
    def __init__(self, path: str):
        self.path = path

    def step_end(self, parts, step, batch, metrics, timer) -> None:
        rm = parts.reward_model
        offloaded = rm is not None and all(p.untyped_storage().nbytes() == 0  # storages released
                                           for m in rm.engine.modules for p in m.parameters())
        plen = batch["prompts"].shape[1]
        lines = []
        for i in range(batch["input_ids"].shape[0]):
            keep = batch["attention_mask"][i].bool()
            resp = batch["responses"][i][keep[plen:]]
            lines.append({"step": step, "rank": parts.state.rank, "ids": batch["input_ids"][i][keep].tolist(),
                          "response": resp.tolist(), "score": float(batch["token_level_scores"][i].sum()),
                          "rm_offloaded": offloaded})
        if parts.state.is_coordinator:
            lines.append({"step": step, "metrics": {k: v for k, v in metrics.items()
                                                    if k.startswith(("reward_model/", "timing_s/reward_model"))}})
        with open(f"{self.path}.rank{parts.state.rank}", "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    bus = observe_from_command_line()
    run_async_trainer("--rows", lambda path: RowWriter(path) if bus is None else Observers(RowWriter(path),
                                                                                           TrainedRows(bus)))
