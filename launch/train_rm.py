"""Bradley-Terry reward-model training on preference pairs (`prompt`, `chosen`, `rejected` parquet).

    torchrun --nproc_per_node=N launch/train_rm.py --model HF_DIR --train-file pairs.parquet --out RM_DIR \
        [--val-file held_out.parquet | --val-fraction 0.1] [--epochs 2] [--batch-size 32] [--lr 1e-5] \
        [--max-length 512] [--tp 1] [--pp 1] [--device auto|cpu|cuda]

The model starts from a causal LM (e.g. the SFT warm start) or a reward model. After every epoch the held-out
pairwise accuracy is printed. The result is a Hugging Face *ForSequenceClassification directory (one label) for
`reward_model.model.path`. Synthetic pairs: `python launch/preprocess_data.py synthetic-preferences`.
"""
import argparse
import json
import sys

from rlhf_mcore.cli import report_user_errors
from rlhf_mcore.trainer.rm_training import run_train_rm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face directory to start from (causal LM or reward model)")
    ap.add_argument("--train-file", required=True, help="preference parquet: prompt, chosen, rejected")
    ap.add_argument("--val-file", default=None, help="held-out preference parquet (default: --val-fraction of train)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--out", required=True, help="output Hugging Face directory")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per optimizer step (all ranks)")
    ap.add_argument("--micro-batch-pairs", type=int, default=4, help="pairs per forward/backward per rank")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=512, help="tokens per sequence; longer pairs are dropped")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--report", default=None, help="write the epoch accuracies as JSON here")
    a = ap.parse_args()
    if a.epochs < 1 or a.batch_size < 1 or a.micro_batch_pairs < 1 or a.lr <= 0:
        ap.error("--epochs, --batch-size and --micro-batch-pairs must be >= 1 and --lr > 0")

    def body():
        history = run_train_rm(a.model, a.train_file, a.out, val_file=a.val_file, val_fraction=a.val_fraction,
                               epochs=a.epochs, batch_size=a.batch_size, micro_batch_pairs=a.micro_batch_pairs,
                               lr=a.lr, max_length=a.max_length, tp=a.tp, pp=a.pp, seed=a.seed,
                               warmup_steps=a.warmup_steps, device=a.device)
        if a.report:
            with open(a.report, "w") as f:
                json.dump(history, f, indent=1)
        return 0

    return report_user_errors(body)


if __name__ == "__main__":
    sys.exit(main())
