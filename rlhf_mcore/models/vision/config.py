"""A LLaVA `config.json` -> the vision tower's and the projector's shapes, and their Megatron `TransformerConfig`s.

Supported: `LlavaForConditionalGeneration` with a SigLIP vision tower (`siglip_vision_model`) and a text model this
project already converts exactly (Qwen2, Llama 3, Qwen3: `hf_config.ModelShape`), a single `vision_feature_layer`
and a two-layer projector (`linear_1`, `projector_hidden_act`, `linear_2`). That is e.g.
`llava-hf/llava-interleave-qwen-0.5b-hf` (SigLIP so400m + Qwen2). SigLIP is the tower megatron-core's
`CLIPViTModel(model_subtype="siglip")` maps onto without a gap: a biased patch convolution, learned position
embeddings, no class token and no pre-norm (CLIP's class token, pre-layernorm and quick-GELU would be a second
variant; it is refused here with the reason).

What LLaVA's forward reads from the tower: the hidden states after layer `vision_feature_layer` (HF's
`hidden_states[k]`, which never include SigLIP's `post_layernorm`), all patches (`vision_feature_select_strategy`
"full"; "default" would drop a class token SigLIP does not have). So the Megatron tower is built with exactly the
layers that feed the features (`used_layers`) and no final norm; the tensors LLaVA never reads (later layers,
`post_layernorm`, the pooling `head`) are carried through unchanged on export (`weights.passthrough_names`).
Nothing here imports torch or megatron at module level.
"""
from __future__ import annotations

from dataclasses import dataclass

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
TEXT_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
VISION_MODEL_TYPES = ("siglip_vision_model",)
# HF activation name -> torch.nn.functional.gelu's `approximate`
GELU_APPROXIMATE = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class VisionShape:
    """The SigLIP tower, the projector and LLaVA's glue, as read from a LLaVA config.json.

    `num_layers` is the tower's depth in the checkpoint; `used_layers` how many of them produce the features
    (vision_feature_layer -1: all; -2: all but the last). `image_token_id` marks the positions of the text that
    receive image features (`tokens_per_image` of them per image, in order); `text_hidden_size` is the projector's
    output (and inner) width.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_layers: int
    used_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    gelu_approximate: str  # the tower MLP's activation
    use_head: bool  # SigLIP's attention-pooling head in the checkpoint (never used by LLaVA)
    text_hidden_size: int
    projector_gelu_approximate: str
    projector_bias: bool
    image_token_id: int

    # qkv_segments / split_qkv read these (the same fused QKV layout as the text model's, one head per group)
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return 1

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_llava_config(cls, cfg: dict, error=ValueError) -> "VisionShape":
        """Parsed from a LLaVA config dict; an unsupported setting raises `error` (hf_config passes its
        UnsupportedModelError) naming the key and the value."""
        _unsupported = error
        vision = cfg.get("vision_config") or {}
        vtype = vision.get("model_type")
        if vtype not in VISION_MODEL_TYPES:
            raise _unsupported(
                f"vision_config.model_type={vtype!r} is not supported; supported: {VISION_MODEL_TYPES} (SigLIP, which "
                "megatron-core's CLIPViTModel 'siglip' variant reproduces: no class token, no pre-layernorm).")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise _unsupported(f"vision_feature_layer={layer!r} is not supported: pass one layer index (an int), not "
                               "a list (several layers concatenated).")
        depth = int(vision.get("num_hidden_layers", 12))
        used = depth + 1 + layer if layer < 0 else layer
        if not 1 <= used <= depth:
            raise _unsupported(f"vision_feature_layer={layer} selects {used} of the tower's {depth} layers; it must "
                               "select at least one (-1 = the last layer's output).")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy != "full":
            raise _unsupported(f"vision_feature_select_strategy={strategy!r} is not supported with SigLIP: 'default' "
                               "drops a class token SigLIP does not have (one real patch would be lost); set 'full'.")
        acts = {"vision_config.hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh"),
                "projector_hidden_act": cfg.get("projector_hidden_act", "gelu")}
        for key, act in acts.items():
            if act not in GELU_APPROXIMATE:
                raise _unsupported(f"{key}={act!r} is not supported; supported: {sorted(GELU_APPROXIMATE)}.")
        image, patch = vision.get("image_size", 224), vision.get("patch_size", 16)
        if not isinstance(image, int) or not isinstance(patch, int) or image % patch:
            raise _unsupported(f"vision_config image_size={image!r}, patch_size={patch!r}: square images of a size "
                               "divisible by the patch size are supported.")
        hidden, heads = int(vision.get("hidden_size", 768)), int(vision.get("num_attention_heads", 12))
        if hidden % heads:
            raise _unsupported(f"vision_config.hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        token = cfg.get("image_token_id", cfg.get("image_token_index"))
        if token is None:
            raise _unsupported("config.json of LlavaForConditionalGeneration lacks 'image_token_index'")
        return cls(
            hidden_size=hidden, ffn_hidden_size=int(vision.get("intermediate_size", 3072)), num_attention_heads=heads,
            num_layers=depth, used_layers=used, image_size=image, patch_size=patch,
            num_channels=int(vision.get("num_channels", 3)), layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            gelu_approximate=GELU_APPROXIMATE[acts["vision_config.hidden_act"]],
            use_head=bool(vision.get("vision_use_head", True)),
            text_hidden_size=int(cfg["text_config"]["hidden_size"]),
            projector_gelu_approximate=GELU_APPROXIMATE[acts["projector_hidden_act"]],
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)), image_token_id=int(token))


def text_config_dict(cfg: dict, error=ValueError) -> dict:
    """The LLaVA config's text model as a causal-LM config dict that `ModelShape.from_config_dict` parses."""
    _unsupported = error
    text = dict(cfg.get("text_config") or {})
    mtype = text.get("model_type")
    if mtype not in TEXT_MODEL_TYPES:
        raise _unsupported(f"text_config.model_type={mtype!r} is not supported in a LLaVA model; supported: "
                           f"{sorted(TEXT_MODEL_TYPES)}.")
    text["architectures"] = [TEXT_MODEL_TYPES[mtype]]
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    text.setdefault("dtype", cfg.get("dtype") or cfg.get("torch_dtype"))
    return text


def validate_vision_layout(vision: VisionShape, tp: int) -> None:
    """The tower and the projector shard over the language model's TP group: TP must divide their widths."""
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError

    for what, n in (("vision_config.num_attention_heads", vision.num_attention_heads),
                    ("vision_config.intermediate_size", vision.ffn_hidden_size),
                    ("text_config.hidden_size (the projector's width)", vision.text_hidden_size)):
        if n % tp:
            raise PipelineLayoutError(f"tensor parallel size {tp} must divide {what}={n} (the vision tower and the "
                                      "projector are split over the language model's TP ranks)")


def _common(tp: int, dtype, on_cpu: bool, perform_initialization: bool) -> dict:
    import torch

    return dict(hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
                bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                apply_rope_fusion=False, persist_layer_norm=False, gated_linear_unit=False,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, pipeline_dtype=dtype,
                params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                use_cpu_initialization=on_cpu, perform_initialization=perform_initialization, init_method_std=0.02)


def vision_transformer_config(vision: VisionShape, *, tp: int, dtype, on_cpu: bool, perform_initialization: bool):
    """The tower's `TransformerConfig`: pre-norm LayerNorm layers with biased linears and a GELU MLP, the layers that
    feed LLaVA's features (the tower lives whole on the first pipeline stage: pipeline size 1 here)."""
    from functools import partial

    import torch
    from megatron.core.transformer import TransformerConfig

    validate_vision_layout(vision, tp)
    return TransformerConfig(
        num_layers=vision.used_layers, hidden_size=vision.hidden_size, ffn_hidden_size=vision.ffn_hidden_size,
        num_attention_heads=vision.num_attention_heads, kv_channels=vision.head_dim, normalization="LayerNorm",
        layernorm_epsilon=vision.layer_norm_eps, add_bias_linear=True, add_qkv_bias=True,
        activation_func=partial(torch.nn.functional.gelu, approximate=vision.gelu_approximate),
        **_common(tp, dtype, on_cpu, perform_initialization))


def projector_transformer_config(vision: VisionShape, *, tp: int, dtype, on_cpu: bool, perform_initialization: bool):
    """The projector's `TransformerConfig`: Megatron's MLP from the tower's width to the text width and back to it
    (`linear_1`, GELU, `linear_2`)."""
    from functools import partial

    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=vision.text_hidden_size, ffn_hidden_size=vision.text_hidden_size,
        num_attention_heads=tp, add_bias_linear=vision.projector_bias,  # heads: unused, TP must divide them
        activation_func=partial(torch.nn.functional.gelu, approximate=vision.projector_gelu_approximate),
        **_common(tp, dtype, on_cpu, perform_initialization))
