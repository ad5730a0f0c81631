"""Hugging Face `config.json` -> the model's shape, and from it Megatron-Core's `TransformerConfig` + GPTModel args.

Five families are supported, each with exactly the features Megatron's GPTModel reproduces bit for bit:

- Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): QKV bias, RMSNorm, SwiGLU, RoPE theta, tied or untied embeddings;
- Llama 3 (`LlamaForCausalLM`): no biases, RoPE with the `llama3` frequency scaling (or none);
- Qwen3 (`Qwen3ForCausalLM`): per-head RMSNorm on queries and keys (QK-norm), no QKV bias, a head_dim that
  may differ from hidden / heads;
- Qwen3-MoE (`Qwen3MoeForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`, with its sigmoid-gated shared expert):
  the attention of Qwen3 / Qwen2, and mixture-of-experts MLPs (softmax top-k routing, `norm_topk_prob`, dense layers
  from `mlp_only_layers` / `decoder_sparse_step`); see `rlhf_mcore.models.moe`.

A LLaVA model (`LlavaForConditionalGeneration` with a SigLIP tower and one of the dense text models above) parses to
its text model's shape with `vision` set (`rlhf_mcore.models.vision.config.VisionShape`): everything that reads the
language model's shape keeps working, and `build_model` puts the tower and the projector in front of it.

Everything else (another architecture, sliding-window attention, another RoPE scaling, biases where Megatron
would put them elsewhere) fails here with a message naming the key and what is supported, before any model is
built. The config is parsed from the raw JSON so both transformers 4 (`rope_theta` + `rope_scaling`) and
transformers 5 (`rope_parameters`) layouts work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from rlhf_mcore.errors import UserError
from rlhf_mcore.models.moe import moe_config_kwargs, moe_shape_fields, validate_expert_layout
from rlhf_mcore.models.vision.config import LLAVA_ARCHITECTURE, VisionShape, text_config_dict, validate_vision_layout

# HF architecture name -> family. The token-classification names are what `save_hf_checkpoint` writes for a
# critic (a width-1 `score` head), so a saved critic can be loaded again.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForTokenClassification": "qwen2",
    "LlamaForTokenClassification": "llama",
    "Qwen3ForTokenClassification": "qwen3",
    "Qwen2ForSequenceClassification": "qwen2",
    "LlamaForSequenceClassification": "llama",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForTokenClassification": "qwen3_moe",
    "Qwen2MoeForTokenClassification": "qwen2_moe",
    "Qwen3MoeForSequenceClassification": "qwen3_moe",
    "Qwen2MoeForSequenceClassification": "qwen2_moe",
}
CAUSAL_LM_ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
TOKEN_CLASSIFICATION_ARCHITECTURE = {
    "qwen2": "Qwen2ForTokenClassification", "llama": "LlamaForTokenClassification",
    "qwen3": "Qwen3ForTokenClassification", "qwen3_moe": "Qwen3MoeForTokenClassification",
    "qwen2_moe": "Qwen2MoeForTokenClassification",
}
# What `save_hf_checkpoint` writes for a reward model (a width-1 `score` head without bias, read at the last token).
SEQUENCE_CLASSIFICATION_ARCHITECTURE = {
    "qwen2": "Qwen2ForSequenceClassification", "llama": "LlamaForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "qwen2_moe": "Qwen2MoeForSequenceClassification",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
DEFAULT_VOCAB_DIVISOR = 128  # Megatron's make_vocab_size_divisible_by


class UnsupportedModelError(UserError, ValueError):
    """The HF checkpoint uses an architecture or feature this project cannot convert exactly (a user's input: the
    entry points report it as one line)."""


def read_config_json(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir!s}; pass a Hugging Face model directory "
                                "(config.json + *.safetensors).")
    return json.loads(path.read_text())


def load_hf_config(hf_dir):
    """The directory's `transformers` config object, after checking that the model is one we support."""
    from transformers import AutoConfig

    ModelShape.from_config_dict(read_config_json(hf_dir))  # raises UnsupportedModelError with the reason
    return AutoConfig.from_pretrained(str(hf_dir))


def _rope_parameters(cfg: dict) -> tuple[float, Optional[dict]]:
    """(theta, llama3 scaling dict or None) from either transformers 4 or 5 config layouts."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} (config rope_scaling/rope_parameters) is not supported; supported: "
            f"{SUPPORTED_ROPE_TYPES}.")
    if rope_type == "default":
        return float(theta), None
    try:
        llama3 = {k: float(merged[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")}
    except KeyError as e:
        raise UnsupportedModelError(f"llama3 rope scaling needs key {e.args[0]!r} in rope_scaling/rope_parameters"
                                    ) from None
    return float(theta), llama3


@dataclass(frozen=True)
class ModelShape:
    """What the converters, the layer specs and the FLOP model need to know about a checkpoint.

    `head_dim` is the per-head width (Qwen3 may have head_dim * heads != hidden_size); `ffn_hidden_size` is
    the SwiGLU inner width (gate and up each have that many rows); `vocab_size` is the HF embedding's row
    count, before Megatron's padding (see `padded_vocab_size`). MoE models (`num_experts` > 0) also set the
    routed experts' width `moe_ffn_hidden_size`, `moe_top_k`, `norm_topk_prob`, `moe_layers` (the global indices of
    the sparse layers; the others are dense with `ffn_hidden_size`) and `shared_expert_ffn_hidden_size` (Qwen2-MoE's
    gated shared expert; 0: none).
    """

    family: str  # "qwen2" | "llama" | "qwen3" | "qwen3_moe" | "qwen2_moe"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_llama3: Optional[tuple] = None  # (factor, low_freq_factor, high_freq_factor, original_max_pos)
    torch_dtype: str = "float32"  # the checkpoint's dtype, as written in config.json
    architecture: str = ""
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple = ()
    shared_expert_ffn_hidden_size: int = 0
    vision: Optional[VisionShape] = None  # a LLaVA model's tower and projector (the fields above: its text model)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dir(cls, hf_dir) -> "ModelShape":
        return cls.from_config_dict(read_config_json(hf_dir))

    @classmethod
    def from_config_dict(cls, cfg: dict) -> "ModelShape":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise UnsupportedModelError(
                f"config.json has a quantization_config (quant_method {method!r}): quantized checkpoints are not "
                "supported (their weights would load without their scales). Give the unquantized (bf16) "
                "checkpoint; FP8 rollout quantizes the actor's weights itself "
                "(actor_rollout_ref.rollout.quantization=fp8).")
        if arch == LLAVA_ARCHITECTURE:  # the text model's shape, with the tower and the projector beside it
            text = cls.from_config_dict(text_config_dict(cfg, UnsupportedModelError))
            if text.is_moe:
                raise UnsupportedModelError("a LLaVA model with a mixture-of-experts text model is not supported.")
            return replace(text, architecture=arch, vision=VisionShape.from_llava_config(cfg, UnsupportedModelError))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} (config.json 'architectures') is not supported; supported: "
                f"{sorted(CAUSAL_LM_ARCHITECTURE.values())} "
                f"(and their *ForTokenClassification critics and *ForSequenceClassification reward models), and "
                f"{LLAVA_ARCHITECTURE} with a SigLIP vision tower.")
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key):
            if key not in cfg:
                raise UnsupportedModelError(f"config.json of {arch} lacks {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of "
                                        f"num_key_value_heads={kv_heads}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU).")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported; set it to false (Megatron's "
                                        "GPTModel here runs full attention in every layer).")
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported.")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported (Megatron would add biases to every linear).")
        if family == "qwen2_moe" and not cfg.get("qkv_bias", True):
            raise UnsupportedModelError(f"qkv_bias=false is not supported for {arch}; supported: qkv_bias=true.")
        if family in ("qwen2", "qwen2_moe"):
            qkv_bias = True
        else:
            if cfg.get("attention_bias"):
                raise UnsupportedModelError(
                    f"attention_bias=true is not supported for {arch}: HF adds a bias to o_proj too, which "
                    "Megatron's add_qkv_bias does not. Supported: attention_bias=false.")
            qkv_bias = False
        theta, llama3 = _rope_parameters(cfg)
        moe = {}
        if family.endswith("_moe"):
            moe = moe_shape_fields(cfg, arch, int(need("num_hidden_layers")), UnsupportedModelError)
        return cls(
            family=family, num_layers=int(need("num_hidden_layers")), hidden_size=hidden,
            num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            ffn_hidden_size=int(need("intermediate_size")), vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"), rope_theta=theta,
            rope_llama3=None if llama3 is None else (llama3["factor"], llama3["low_freq_factor"],
                                                      llama3["high_freq_factor"],
                                                      llama3["original_max_position_embeddings"]),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), architecture=arch, **moe)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
        """Megatron's padded vocabulary: the next multiple of `divisible_by × tp` (padded rows are zero)."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the HF model (embeddings counted once when tied)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_attention_heads + 2 * self.num_kv_heads) + self.num_attention_heads * hd * h
        if self.qkv_bias:
            attn += hd * (self.num_attention_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 2 * h
        total = self.num_layers * layer + h + 3 * h * self.ffn_hidden_size * (self.num_layers - len(self.moe_layers))
        if self.is_moe:  # router, routed experts, and the shared expert with its gate
            moe = h * self.num_experts + 3 * h * self.moe_ffn_hidden_size * self.num_experts
            if self.shared_expert_ffn_hidden_size:
                moe += 3 * h * self.shared_expert_ffn_hidden_size + h
            total += len(self.moe_layers) * moe
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total


def validate_parallel_layout(shape: ModelShape, tp: int, pp: int, vpp: Optional[int],
                             first: Optional[int] = None, last: Optional[int] = None, ep: int = 1
                             ) -> tuple[Optional[int], Optional[int]]:
    """Fail early, naming the setting, when a layout cannot shard this model; returns the pipeline stage split
    (num_layers_in_first/last_pipeline_stage: the given ones, checked, or a chosen one when PP does not divide the
    layers; see `pipeline_layout`)."""
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError, resolve_split

    if shape.num_attention_heads % tp:
        raise PipelineLayoutError(f"tensor parallel size {tp} must divide num_attention_heads="
                                  f"{shape.num_attention_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise PipelineLayoutError(f"tensor parallel size {tp} and num_key_value_heads={shape.num_kv_heads}: one "
                                  "must divide the other")
    if shape.ffn_hidden_size % tp:
        raise PipelineLayoutError(f"tensor parallel size {tp} must divide intermediate_size={shape.ffn_hidden_size}")
    if shape.is_moe or ep > 1:
        validate_expert_layout(shape, tp, ep)
    if shape.vision is not None:
        validate_vision_layout(shape.vision, tp)
    return resolve_split(shape.num_layers, pp, vpp, first, last)


def transformer_config(shape: ModelShape, *, tp: int, pp: int, vpp: Optional[int], dtype: torch.dtype,
                       on_cpu: bool, perform_initialization: bool = True, ep: int = 1, **overrides):
    """Megatron `TransformerConfig` reproducing the HF model. `overrides` are passed through (e.g. recompute,
    moe_aux_loss_coeff); num_layers_in_first/last_pipeline_stage among them are checked, and chosen when unset and
    PP does not divide the layers. ep: expert parallel size (MoE models)."""
    from megatron.core.transformer import TransformerConfig

    first, last = validate_parallel_layout(shape, tp, pp, vpp,
                                           overrides.pop("num_layers_in_first_pipeline_stage", None),
                                           overrides.pop("num_layers_in_last_pipeline_stage", None), ep=ep)
    kwargs = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        attention_softmax_in_fp32=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=on_cpu,
        perform_initialization=perform_initialization, init_method_std=0.02,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
    )
    moe_keys = sorted(k for k in overrides if k.startswith("moe_"))
    if moe_keys and not shape.is_moe:
        raise ValueError(f"{moe_keys} (megatron.override_transformer_config) are for mixture-of-experts models; "
                         f"{shape.architecture} has no experts: remove them.")
    if shape.is_moe:
        kwargs.update(moe_config_kwargs(shape, ep, overrides))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(shape: ModelShape, *, tp: int, role: str,
                     vocab_divisor: int = DEFAULT_VOCAB_DIVISOR) -> dict:
    """GPTModel constructor arguments other than config/spec/pre/post/pg (vocab padded for this TP)."""
    return dict(
        vocab_size=shape.padded_vocab_size(tp, vocab_divisor),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and role not in ("critic", "reward"),
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        rotary_percent=1.0,
    )
