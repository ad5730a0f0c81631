"""Write a tiny random Hugging Face model directory (for tests and CPU demos).

    python launch/make_tiny_model.py --arch qwen2 --out /tmp/tiny-qwen2 [--layers 2 --hidden 64 ...]

The directory loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` like a
real Qwen2.5 (qwen2), Llama-3 (llama) or Qwen3 (qwen3) checkpoint; see `rlhf_mcore.models.tiny`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mcore.agents.tasks import multiply_texts  # noqa: E402
from rlhf_mcore.models.tiny import ARCHS, make_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024, help="model vocabulary (embedding rows)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 * hidden)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--init-std", type=float, default=0.2,
                   help="initializer range (0.2 for generation tests; the demos train from 0.02)")
    p.add_argument("--multiply-digits", type=int, default=None,
                   help="also train the tokenizer on the multiply tool task's layout with operands of this many "
                        "digits (its prompt and calculator call become a few tokens each; launch/demo_agent.py)")
    args = p.parse_args(argv)
    out = make_tiny_model(
        args.out, arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, intermediate=args.intermediate, seed=args.seed,
        dtype=args.dtype, init_std=args.init_std,
        tokenizer_texts=multiply_texts(args.multiply_digits) if args.multiply_digits else (),
    )
    print(f"wrote tiny {args.arch} model to {out}")
    return out


if __name__ == "__main__":
    main()
