"""Supervised fine-tuning (response-only loss) on the train engine, for warm starts before RL.

    torchrun --nproc_per_node=N launch/sft.py --model HF_DIR --train-file rows.parquet --out OUT_DIR \
        [--steps 200] [--batch-size 32] [--lr 1e-5] [--max-length 512] [--tp 1] [--pp 1] [key=value ...]

Rows are veRL-schema parquet; the target is a `response` column, `extra_info.messages` (multi-turn: the loss on
the assistant turns only) or `extra_info.answer`. `--tools YAML` lists a tool config's schemas in the prompts' chat
template, as the RL run with that multi_turn.tool_config_path does. Extra `key=value`
arguments are run-config overrides (e.g. trainer.device=cpu). The result is a Hugging Face directory.
"""
import argparse
import sys

from rlhf_mcore.cli import report_user_errors
from rlhf_mcore.trainer.sft import run_sft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model directory to start from")
    ap.add_argument("--train-file", required=True, help="parquet in veRL's schema")
    ap.add_argument("--out", required=True, help="output Hugging Face directory")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step (all ranks)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=512, help="prompt + response tokens; longer rows are dropped")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tools", default=None, help="tool config YAML (e.g. configs/tools/calculator.yaml)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.steps < 1 or a.batch_size < 1 or a.lr <= 0:
        ap.error("--steps and --batch-size must be >= 1 and --lr > 0")
    return report_user_errors(lambda: run_sft(
        a.model, a.train_file, a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr, max_length=a.max_length,
        tp=a.tp, pp=a.pp, seed=a.seed, warmup_steps=a.warmup_steps, overrides=a.overrides,
        tool_config=a.tools) and 0)


if __name__ == "__main__":
    sys.exit(main())
