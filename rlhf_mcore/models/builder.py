"""Build the Megatron GPTModel chunks of an actor, reference policy or critic from an HF model directory.

`build_model` returns one `GPTModel` per virtual pipeline stage held by this rank (a list of one without
virtual PP), with `pre_process` / `post_process` set from the layout, RoPE frequencies equal to HF's, and
(by default) the HF weights loaded shard by shard. It does not wrap the chunks in DDP: the train engine does.

Forward convention (every chunk): `chunk(input_ids (B, S), position_ids (B, S), attention_mask, packed_seq_params=)`
with `attention_mask` a bool (B, 1, S, S) tensor, True = masked out, or None for plain causal attention. The
last stage returns vocabulary-parallel logits (B, S, V_padded / TP) — not gathered; the critic returns values
(B, S, 1). Packed (THD) input is `input_ids (1, total)`, attention_mask None and
`PackedSeqParams(qkv_format="thd", cu_seqlens_q=..., cu_seqlens_kv=..., max_seqlen_q=..., max_seqlen_kv=...)`.

About position_ids: Megatron's RoPE uses positions 0..S-1 of the row (restarting at every document when
packed; computed on the device, see `rope.install_packed_rope`), not `position_ids`. RoPE only sees position
differences, so a left-padded row, whose real tokens sit at S-n..S-1 instead of 0..n-1, gets the same
attention scores up to float rounding (checked against HF at 1e-4 in tests/test_models.py).

Each chunk carries `hf_shape` (the `ModelShape`), `model_role`, `hf_dir` and `layer_ids` (the global indices of
its decoder layers, from `pipeline_layout.chunk_layers`, checked against Megatron's); the loader and the exporter
read them (through DDP-style wrappers too). When PP does not divide the layers and
`num_layers_in_first/last_pipeline_stage` are not in `config_overrides`, a split is chosen
(`pipeline_layout.choose_split`); rank 0 prints an uneven split once.

A LLaVA directory (`LlavaForConditionalGeneration`, SigLIP tower) builds `vision.model.VisionLanguageModel` chunks:
GPTModels whose first stage also holds the tower and the projector, called with `pixel_values=` (see there);
`hf_layout` on each chunk names the checkpoint's tensor prefixes (`vision.weights.LlavaNames`). As a critic (the VLA
trainer's PPO) it is the same tower, projector and text model with the value head in place of the LM head (the
checkpoint's `lm_head` is not read; a `score.*` under the text prefix, when present, fills the head).
"""
from __future__ import annotations

from typing import Optional

import torch

from rlhf_mcore.models.fused_layers import fused_kernels_default
from rlhf_mcore.models.hf_config import ModelShape, gpt_model_kwargs, transformer_config
from rlhf_mcore.models.layer_specs import layer_spec, resolve_backend
from rlhf_mcore.models.moe import moe_block_spec
from rlhf_mcore.models.pipeline_layout import chunk_layers, describe
from rlhf_mcore.models.rope import install_packed_rope, install_rope

ROLES = ("actor", "ref", "critic", "reward")
_LOGGED_SPLITS: set = set()  # (layers, pp, vpp, first, last) already printed by this process


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 parameters on GPU (the optimizer keeps fp32 master weights), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(hf_dir, state, *, role: str = "actor", dtype: Optional[torch.dtype] = None,
                load_weights: bool = True, attention_backend: str = "auto", config_overrides: Optional[dict] = None,
                vocab_divisor: int = 128, fused_kernels: Optional[bool] = None, lora=None, lora_seed: int = 0,
                freeze_vision: bool = False) -> list:
    """GPTModel chunks (one per virtual pipeline stage of this rank) for the HF model in `hf_dir`.

    role: "actor" / "ref" (language-model head, tied to the embedding when the checkpoint ties them),
    "critic" (a width-1 value head, see `value_head.ValueHead`) or "reward" (the same head without bias: a
    `*ForSequenceClassification` reward model's `score`; from a causal LM it starts at the head's init).
    dtype None: bf16 on GPU, fp32 on CPU.
    attention_backend: see `layer_specs.BACKENDS`. config_overrides: extra `TransformerConfig` fields
    (e.g. recompute_granularity). load_weights=False leaves Megatron's random initialisation.
    fused_kernels: SwiGLU and packed RoPE as fused Triton kernels (`fused_layers`); None: on for CUDA models
    on the "sdpa" backend when triton is installed.
    lora: a `lora.LoraSpec` (None: no adapters): adapters on the base weights once loaded, everything else frozen
    (see `rlhf_mcore.models.lora.apply_lora`; `lora_seed` seeds their initialisation).
    freeze_vision (LLaVA models): the vision tower gets no gradients (`vision.model.freeze_vision`).
    """
    from megatron.core.models.gpt import GPTModel

    from rlhf_mcore.models.hf_loader import load_hf_weights
    from rlhf_mcore.models.value_head import ValueHead

    if role not in ROLES:
        raise ValueError(f"role={role!r}; choose one of {ROLES}.")
    shape = ModelShape.from_hf_dir(hf_dir)
    vision = shape.vision
    if vision is not None and (role == "reward" or lora is not None):
        raise ValueError(f"{shape.architecture} builds as a policy (role actor or ref) or a critic, without LoRA; got "
                         f"role={role!r}{', LoRA' if lora is not None else ''}: reward models and adapters of "
                         "vision-language models are not supported yet.")
    if freeze_vision and vision is None:
        raise ValueError(f"freeze_vision=True but {hf_dir} is a text model ({shape.architecture}): it has no vision "
                         "tower to freeze; set it to false.")
    dtype = dtype or default_dtype(state.device)
    dims = state.dims
    on_cpu = state.device.type == "cpu"
    backend = resolve_backend(attention_backend)
    if fused_kernels is None:
        fused_kernels = fused_kernels_default(state.device, backend) and not shape.is_moe
    elif fused_kernels and shape.is_moe:
        raise ValueError("fused_kernels=True is for dense models: the MoE layers' experts use Megatron's own MLP.")
    elif fused_kernels and backend != "sdpa":
        raise ValueError(f"fused_kernels=True needs the 'sdpa' layer spec (attention backend here: {backend!r}); "
                         "Transformer Engine's spec fuses these itself.")
    overrides = {**({"use_te_activation_func": True} if fused_kernels else {}), **(config_overrides or {})}
    config = transformer_config(shape, tp=dims.tp, pp=dims.pp, vpp=dims.vpp, dtype=dtype, on_cpu=on_cpu,
                                perform_initialization=not load_weights, ep=getattr(dims, "ep", 1), **overrides)
    config.fused_rope_kernel = bool(fused_kernels)  # read by rope.apply_rope_packed
    if config.sequence_parallel and backend != "te":
        raise ValueError("sequence_parallel=True needs the Transformer Engine layer spec: the local spec's torch "
                         f"RMSNorm refuses it (attention backend here: {backend!r}). Turn sequence parallelism off "
                         "or install Transformer Engine.")
    spec = layer_spec(shape, backend, fused_swiglu=bool(fused_kernels))
    install_packed_rope()
    model_cls, extra = GPTModel, {}
    if vision is not None:
        from rlhf_mcore.models.vision.model import VisionLanguageModel
        from rlhf_mcore.models.vision.weights import LlavaNames

        model_cls = VisionLanguageModel
        extra = dict(vision=vision, dtype=dtype, on_cpu=on_cpu, perform_initialization=not load_weights)
        layout = LlavaNames.detect(hf_dir)
    n_virtual = dims.vpp or 1
    chunks = []
    for vp in range(n_virtual):
        pre = state.is_first_stage and vp == 0
        post = state.is_last_stage and vp == n_virtual - 1
        if shape.is_moe:  # dense and MoE layers: a block spec per (virtual) stage
            spec = moe_block_spec(config, backend, vp if dims.vpp else None, state.pp_rank)
        model = model_cls(config=config, transformer_layer_spec=spec, pre_process=pre, post_process=post,
                          pg_collection=state.pg_collection, vp_stage=vp if dims.vpp else None,
                          **gpt_model_kwargs(shape, tp=dims.tp, role=role, vocab_divisor=vocab_divisor), **extra)
        if vision is not None:
            model.hf_layout = layout
        install_rope(model, shape, state.device)
        if role in ("critic", "reward") and post:
            model.output_layer = ValueHead(shape.hidden_size, dtype=dtype, device=state.device, bias=role == "critic")
        model.to(device=state.device, dtype=dtype)  # torch norms are created in fp32 on the CPU
        model.hf_shape, model.model_role, model.hf_dir = shape, role, str(hf_dir)
        model.layer_ids = _checked_layer_ids(model, config, state.pp_rank, vp)
        chunks.append(model)
    _log_split(config, state)
    if load_weights:
        load_hf_weights(chunks, hf_dir, state)
    if lora is not None:
        from rlhf_mcore.models.lora import apply_lora

        apply_lora(chunks, lora, state, seed=lora_seed)
    if freeze_vision:
        from rlhf_mcore.models.vision.model import freeze_vision as freeze

        freeze(chunks)
    return chunks


def _split(config) -> tuple:
    return (config.num_layers, config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size,
            config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage)


def _checked_layer_ids(model, config, pp_rank: int, vp: int) -> tuple:
    """This chunk's global layer indices from `chunk_layers`, which must be the layers Megatron built."""
    layers, pp, vpp, first, last = _split(config)
    want = tuple(chunk_layers(layers, pp, first, last, vpp)[pp_rank][vp])
    built = tuple(layer.layer_number - 1 for layer in model.decoder.layers)
    if built != want:
        raise RuntimeError(f"Megatron built layers {built} on PP stage {pp_rank} (virtual stage {vp}) but the "
                           f"pipeline layout says {want} ({describe(layers, pp, first, last, vpp)}); this Megatron "
                           "version places layers differently: rlhf_mcore.models.pipeline_layout must follow it.")
    return want


def _log_split(config, state) -> None:
    """Rank 0 prints an uneven stage split once per process (actor, ref and critic share it)."""
    split = _split(config)
    uneven = split[3] is not None or split[4] is not None
    if state.rank == 0 and uneven and split not in _LOGGED_SPLITS:
        _LOGGED_SPLITS.add(split)
        print(f"pipeline stages: {describe(*split[:2], *split[3:], vpp=split[2])}", flush=True)
