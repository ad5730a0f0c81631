"""Convert between a Hugging Face model directory and a Megatron distributed checkpoint, at any TP/PP.

    # HF -> Megatron, sharded for TP=2, PP=2 (4 processes; plain `python` runs a world of one)
    torchrun --nproc_per_node=4 launch/convert_checkpoint.py --direction hf2mcore \\
        --hf-dir Qwen2.5-0.5B-Instruct --mcore-dir ckpt/mcore --tp 2 --pp 2
    # a mixture-of-experts model with its experts split over 2 ranks (expert parallelism)
    torchrun --nproc_per_node=2 launch/convert_checkpoint.py --direction hf2mcore \
        --hf-dir Qwen3-30B-A3B --mcore-dir ckpt/mcore --ep 2
    # Megatron (saved under any layout) -> HF
    python launch/convert_checkpoint.py --direction mcore2hf --mcore-dir ckpt/mcore --out-hf-dir ckpt/hf
    # a training checkpoint (the actor; --role critic for the critic) -> HF
    python launch/convert_checkpoint.py --direction mcore2hf \
        --mcore-dir outputs/run/checkpoints/global_step_100 --out-hf-dir hf_step_100

hf2mcore loads the HF safetensors shard by shard (each rank reads only its slices) and saves the model's
`sharded_state_dict()` with `megatron.core.dist_checkpointing`, plus `hf_meta/` (config.json, tokenizer,
chat template). mcore2hf builds the model from the checkpoint's `hf_meta/` (training checkpoints carry one
too; --hf-dir, when given, replaces it as the config/tokenizer source), loads the checkpoint into this run's
TP/PP layout and writes an HF directory that `transformers` loads to --out-hf-dir. A training checkpoint
(`global_step_N/`, or its `actor/` / `critic/` directory) is checked against its manifest first and refused
when it does not match. The world size must be a multiple of TP×PP (extra ranks are data-parallel replicas).
When PP does not divide the layers, a stage split is chosen (printed), or give it with
--num-layers-in-first/last-pipeline-stage (the keys of `megatron.override_transformer_config` in a run config);
the checkpoint loads under any other split.
`--role critic` converts a critic (value head saved as `score.*` in HF form).
A LoRA training checkpoint (adapters only, `actor_rollout_ref.model.lora_rank > 0`) converts on its base (the
path it names, or --hf-dir with the same hash) to the merged HF directory, and with --out-adapter-dir also to a
PEFT adapter directory (`peft.PeftModel.from_pretrained(base, dir)` loads it).

The `if __name__ == "__main__":` guard is required: dist_checkpointing's writer spawns helper processes that
re-import this file.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_mcore.cli import report_user_errors  # noqa: E402
from rlhf_mcore.config import ConfigError  # noqa: E402
from rlhf_mcore.trainer.checkpoint import CheckpointError  # noqa: E402


def hf_to_mcore(hf_dir, mcore_dir, state, role: str = "actor", split: dict | None = None) -> Path:
    from rlhf_mcore.models import build_model
    from rlhf_mcore.models.mcore_checkpoint import save_mcore_checkpoint

    chunks = build_model(hf_dir, state, role=role, config_overrides=split)
    return save_mcore_checkpoint(chunks, state, mcore_dir, hf_dir)


def checked_model_dir(mcore_dir, role: str | None) -> Path:
    """The distributed checkpoint to convert, checked before anything in it is unpickled.

    `mcore_dir` may be a trainer checkpoint (`global_step_N/`: its `<role>/`, default `actor/`, is converted) or a
    model directory inside one (`global_step_N/actor/`): the trainer checkpoint must pass its manifest check.
    Any other directory (an hf2mcore output) is returned as is. In every case torch's `.metadata` pickle must
    name only checkpoint-metadata classes. Raises ValueError naming the problem."""
    from rlhf_mcore.trainer.manifest import COMPLETE, MANIFEST, check_metadata_pickle, verify_checkpoint

    path = Path(mcore_dir)
    root = None
    if (path / MANIFEST).is_file() or (path / COMPLETE).is_file():
        root, path = path, path / (role or "actor")
    elif (path.parent / MANIFEST).is_file():
        root = path.parent
    problem = verify_checkpoint(root) if root is not None else None
    if problem:
        raise ValueError(f"training checkpoint {root} is unusable: {problem}; convert an earlier global_step_N")
    if (path / ".metadata").is_file():
        problem = check_metadata_pickle(path / ".metadata")
        if problem:
            raise ValueError(f"{path / '.metadata'} is {problem}; refusing to load it")
    return path


def lora_base(mcore_dir) -> dict | None:
    """A LoRA training checkpoint's `lora_base` (base path, hash, adapter spec); None for any other checkpoint."""
    from rlhf_mcore.engine.checkpoint import LORA_BASE_KEY
    from rlhf_mcore.engine.safe_load import load_common

    common = Path(mcore_dir) / "common.pt"
    return load_common(mcore_dir).get(LORA_BASE_KEY) if common.is_file() else None


def lora_to_hf(mcore_dir, out_hf_dir, state, base: dict, hf_dir=None, role: str | None = None,
               split: dict | None = None, out_adapter_dir=None) -> Path:
    """A LoRA training checkpoint (adapters only) on its base (the saved path, or --hf-dir: it must hash the
    same) -> the merged HF directory, and the PEFT adapter directory when `out_adapter_dir` is given."""
    from rlhf_mcore.engine.safe_load import load_distributed
    from rlhf_mcore.models import build_model, save_hf_checkpoint
    from rlhf_mcore.models.lora import (
        LoraSpec,
        base_hash,
        load_trainable_state_dict,
        save_peft_adapter,
        trainable_sharded_state_dict,
    )
    from rlhf_mcore.models.mcore_checkpoint import saved_role

    src = Path(hf_dir) if hf_dir is not None else Path(base["path"])
    if not (src / "config.json").is_file() or base_hash(src) != base["sha256"]:
        raise CheckpointError(f"{mcore_dir} holds LoRA adapters trained on the base {base['path']}; {src} is "
                              f"{'not that model' if (src / 'config.json').is_file() else 'not a model directory'}: "
                              "pass the base's Hugging Face directory as --hf-dir.")
    spec = LoraSpec(base["rank"], base["alpha"], tuple(base["target_modules"]))
    chunks = build_model(src, state, role=role or saved_role(mcore_dir), config_overrides=split, lora=spec)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    loaded = load_distributed({k: trainable_sharded_state_dict(c) for k, c in zip(keys, chunks)}, mcore_dir)
    for k, c in zip(keys, chunks):
        load_trainable_state_dict(c, loaded[k])
    if out_adapter_dir:
        save_peft_adapter(chunks, state, out_adapter_dir, spec, str(src))
    return save_hf_checkpoint(chunks, state, out_hf_dir, src)


def mcore_to_hf(mcore_dir, out_hf_dir, state, hf_dir=None, role: str | None = None, split: dict | None = None,
                out_adapter_dir=None) -> Path:
    from rlhf_mcore.models import build_model, save_hf_checkpoint
    from rlhf_mcore.models.mcore_checkpoint import HF_META, load_mcore_checkpoint, saved_role

    base = lora_base(mcore_dir)
    if base is not None:
        return lora_to_hf(mcore_dir, out_hf_dir, state, base, hf_dir, role, split, out_adapter_dir)
    if out_adapter_dir:
        raise ConfigError(f"--out-adapter-dir: {mcore_dir} holds no LoRA adapters (a full-model checkpoint)")
    meta = Path(hf_dir) if hf_dir is not None else Path(mcore_dir) / HF_META
    if not (meta / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {meta}; pass --hf-dir with the model's HF config and tokenizer "
                                "(checkpoints written by older versions carry none).")
    chunks = build_model(meta, state, role=role or saved_role(mcore_dir), load_weights=False, config_overrides=split)
    load_mcore_checkpoint(chunks, mcore_dir)
    return save_hf_checkpoint(chunks, state, out_hf_dir, meta)


def checked_split(args, model_dir) -> dict:
    """The --num-layers-in-first/last-pipeline-stage given, checked against the model's layers and --pp
    (TransformerConfig overrides); a ConfigError naming the flags otherwise. Runs on every rank before any
    process group exists. The model's own problems (no config.json, TP not dividing heads) are left to
    `build_model`."""
    from rlhf_mcore.models import ModelShape
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError, stage_sizes

    split = {k: v for k, v in (("num_layers_in_first_pipeline_stage", args.num_layers_in_first_pipeline_stage),
                               ("num_layers_in_last_pipeline_stage", args.num_layers_in_last_pipeline_stage))
             if v is not None}
    if not split or not (Path(model_dir) / "config.json").is_file():
        return split
    layers = ModelShape.from_hf_dir(model_dir).num_layers
    try:
        stage_sizes(layers, args.pp, split.get("num_layers_in_first_pipeline_stage"),
                    split.get("num_layers_in_last_pipeline_stage"))
    except PipelineLayoutError as e:
        raise ConfigError(f"--pp {args.pp} with --num-layers-in-first/last-pipeline-stage for the {layers}-layer "
                          f"model in {model_dir}: {e}") from None
    return split


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direction", choices=("hf2mcore", "mcore2hf"), required=True)
    p.add_argument("--hf-dir", help="HF model directory: the input of hf2mcore; for mcore2hf optional, the "
                                    "config/tokenizer source instead of the checkpoint's hf_meta/")
    p.add_argument("--mcore-dir", required=True, help="Megatron distributed checkpoint directory, or a training "
                                                      "checkpoint (global_step_N/ or its actor/, critic/)")
    p.add_argument("--out-hf-dir", help="mcore2hf: the output HF directory (required; from a LoRA checkpoint: the "
                                        "base with the adapters merged)")
    p.add_argument("--out-adapter-dir", help="mcore2hf of a LoRA checkpoint: also write its PEFT adapter directory "
                                             "(adapter_config.json + adapter_model.safetensors) here")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (mixture-of-experts models): each MoE "
                   "layer's experts split over this many of the data-parallel ranks (it must divide them)")
    p.add_argument("--role", choices=("actor", "ref", "critic"), default=None,
                   help="default: actor for hf2mcore, the saved role for mcore2hf")
    for end in ("first", "last"):
        p.add_argument(f"--num-layers-in-{end}-pipeline-stage", type=int, default=None,
                       help=f"decoder layers on the {end} PP stage (the stages between share the rest evenly); "
                            "default: even, or a chosen split when PP does not divide the layers")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = p.parse_args(argv)

    sys.exit(report_user_errors(lambda: convert(args)))


def check_input_dirs(args) -> None:
    """The directories read from must exist: --hf-dir (hf2mcore's input; mcore2hf's optional config source) and,
    for mcore2hf, --mcore-dir. A FileNotFoundError naming the flag and the path otherwise, before anything else
    looks inside them (a missing --mcore-dir used to be reported as "no config.json in <it>/hf_meta")."""
    needed = [("--hf-dir", args.hf_dir, "the Hugging Face model directory")] if args.hf_dir else []
    if args.direction == "mcore2hf":
        needed.append(("--mcore-dir", args.mcore_dir, "the checkpoint to convert (a global_step_N/ directory, its "
                                                      "actor/ or critic/, or an hf2mcore output)"))
    for flag, value, what in needed:
        path = Path(value)
        if not path.exists():
            raise FileNotFoundError(f"{flag} {value}: the directory does not exist; give {what}.")
        if not path.is_dir():
            raise FileNotFoundError(f"{flag} {value}: not a directory; give {what}.")


def convert(args) -> None:
    # every rank checks its arguments (before any process group exists) so that all stop together
    if args.direction == "hf2mcore" and not args.hf_dir:
        raise ConfigError("--direction hf2mcore needs --hf-dir (the Hugging Face model directory to convert)")
    check_input_dirs(args)
    mcore_dir = args.mcore_dir
    if args.direction == "mcore2hf":
        if not args.out_hf_dir:
            raise ConfigError("--direction mcore2hf needs --out-hf-dir (where to write the Hugging Face model)")
        try:
            mcore_dir = checked_model_dir(args.mcore_dir, args.role)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (args.tp * args.pp):
        raise ConfigError(f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the {world} "
                          f"launched processes: launch with `torchrun --nproc_per_node={args.tp * args.pp}`.")
    if (world // (args.tp * args.pp)) % args.ep:
        n = args.tp * args.pp * args.ep
        raise ConfigError(f"--ep {args.ep} does not divide the {world // (args.tp * args.pp)} data-parallel ranks "
                          f"(world {world} / TP×PP): launch with `torchrun --nproc_per_node={n}`.")
    model_dir = args.hf_dir if args.hf_dir else Path(mcore_dir) / "hf_meta"
    split = checked_split(args, model_dir)
    if args.direction == "hf2mcore":
        from rlhf_mcore.models.safetensors_check import model_weight_files

        model_weight_files(args.hf_dir)  # a truncated or corrupt file stops every rank here, naming it

    from rlhf_mcore.parallel import destroy_distributed, init_distributed

    state = init_distributed(tp=args.tp, pp=args.pp, device=args.device, ep=args.ep)
    try:
        if args.direction == "hf2mcore":
            out = hf_to_mcore(args.hf_dir, args.mcore_dir, state, role=args.role or "actor", split=split)
        else:
            out = mcore_to_hf(mcore_dir, args.out_hf_dir, state, hf_dir=args.hf_dir, role=args.role, split=split,
                              out_adapter_dir=args.out_adapter_dir)
        if state.rank == 0:
            print(f"{args.direction}: wrote {out} (TP={args.tp}, PP={args.pp}, EP={args.ep}, "
                  f"world={state.world_size})")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
