"""Convert between a Hugging Face model directory and a Megatron distributed checkpoint, at any TP/PP.

    # HF -> Megatron, sharded for TP=2, PP=2 (4 processes; plain `python` runs a world of one)
    torchrun --nproc_per_node=4 launch/convert_checkpoint.py --direction hf2mcore \\
        --hf-dir Qwen2.5-0.5B-Instruct --mcore-dir ckpt/mcore --tp 2 --pp 2
    # Megatron (saved under any layout) -> HF
    python launch/convert_checkpoint.py --direction mcore2hf --mcore-dir ckpt/mcore --out-hf-dir ckpt/hf

hf2mcore loads the HF safetensors shard by shard (each rank reads only its slices) and saves the model's
`sharded_state_dict()` with `megatron.core.dist_checkpointing`, plus `hf_meta/` (config.json, tokenizer,
chat template). mcore2hf builds the model from `hf_meta/` (or from --hf-dir when given), loads the checkpoint
into this run's TP/PP layout and writes an HF directory that `transformers` loads (to --out-hf-dir, else
--hf-dir). The world size must be a multiple of TP×PP (extra ranks are data-parallel replicas). `--role
critic` converts a critic (value head saved as `score.*` in HF form).

The `if __name__ == "__main__":` guard is required: dist_checkpointing's writer spawns helper processes that
re-import this file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_to_mcore(hf_dir, mcore_dir, state, role: str = "actor") -> Path:
    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.mcore_checkpoint import save_mcore_checkpoint

    chunks = build_model(hf_dir, state, role=role)
    return save_mcore_checkpoint(chunks, state, mcore_dir, hf_dir)


def mcore_to_hf(mcore_dir, out_hf_dir, state, hf_dir=None, role: str | None = None) -> Path:
    from rlhf_mcore.models import build_model, save_hf_checkpoint
    from rlhf_mcore.models.mcore_checkpoint import HF_META, load_mcore_checkpoint, saved_role

    meta = Path(mcore_dir) / HF_META
    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        meta = Path(hf_dir)
    if not (meta / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {meta}; pass --hf-dir with the model's config and tokenizer.")
    chunks = build_model(meta, state, role=role or saved_role(mcore_dir), load_weights=False)
    load_mcore_checkpoint(chunks, mcore_dir)
    return save_hf_checkpoint(chunks, state, out_hf_dir, meta)


def main(argv=None) -> None:
    from rlhf_mcore.lifetime import bind_rank_to_launcher

    bind_rank_to_launcher()  # under torchrun: this rank dies with the agent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direction", choices=("hf2mcore", "mcore2hf"), required=True)
    p.add_argument("--hf-dir", help="HF model directory (input of hf2mcore; config/tokenizer source or output "
                                    "of mcore2hf)")
    p.add_argument("--mcore-dir", required=True, help="Megatron distributed checkpoint directory")
    p.add_argument("--out-hf-dir", help="mcore2hf output directory (default: --hf-dir)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--role", choices=("actor", "ref", "critic"), default=None,
                   help="default: actor for hf2mcore, the saved role for mcore2hf")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = p.parse_args(argv)

    if args.direction == "hf2mcore" and not args.hf_dir:
        p.error("--direction hf2mcore needs --hf-dir (the HF model to convert)")
    out_hf = args.out_hf_dir or args.hf_dir
    if args.direction == "mcore2hf" and not out_hf:
        p.error("--direction mcore2hf needs --out-hf-dir (or --hf-dir) for the output")

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(tp=args.tp, pp=args.pp, device=args.device)
    try:
        if args.direction == "hf2mcore":
            out = hf_to_mcore(args.hf_dir, args.mcore_dir, state, role=args.role or "actor")
        else:
            src = args.hf_dir if args.out_hf_dir else None  # --hf-dir alone is the output, not a source
            out = mcore_to_hf(args.mcore_dir, out_hf, state, hf_dir=src, role=args.role)
        if state.rank == 0:
            print(f"{args.direction}: wrote {out} (TP={args.tp}, PP={args.pp}, world={state.world_size})")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
