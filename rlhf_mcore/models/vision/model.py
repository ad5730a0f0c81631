"""The vision-language policy: a GPTModel whose first pipeline stage also holds a ViT and a projector.

`VisionLanguageModel` is a megatron-core `GPTModel` (same parameters, same names, same TP/PP/VPP layout, same
forward convention as every other chunk, see `builder`) with two submodules on the stage that embeds tokens:

- `vision_model`: megatron-core's `CLIPViTModel` in its SigLIP form (biased patch convolution, learned position
  embeddings, no class token), built with the tower's layers up to LLaVA's `vision_feature_layer` and no final
  norm (`ln_post` is an identity: LLaVA reads hidden states, which never include SigLIP's post-layernorm);
- `vision_projection`: megatron-core's `MultimodalProjector` ("mlp": `linear_1`, GELU, `linear_2`).

Both shard over the language model's TP group (column-parallel QKV / fc1 / linear_1, row-parallel out / fc2 /
linear_2, as a text layer); they are not pipelined: the tower is small next to the text model, and the stage that
embeds the prompt needs its output.

Forward: `chunk(input_ids (B, S), position_ids, attention_mask, pixel_values=(N, C, H, W), ...)` (or
`image_features=` the first stage's `image_embeddings(pixel_values)`, computed once). Every position of
`input_ids` holding `image_token_id` receives one image feature: the N images' `tokens_per_image` features each, in
the order the positions appear row by row (HF LLaVA's `masked_scatter`). A policy's prompt puts its image tokens
first (images as prefix embeddings); anywhere else works the same. Without `pixel_values` (or on a later stage) the
chunk is exactly its GPTModel. The tower's attention is bidirectional (`VisionCoreAttention`: SDPA without a mask).

`freeze_vision(chunks)` stops the tower's gradients (LLaVA's usual fine-tuning: the projector and the text model
train); Megatron's DDP and optimizer then hold no gradient buffer, master copy or optimizer state for it.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlhf_mcore.models.vision.config import VisionShape, projector_transformer_config, vision_transformer_config


class VisionCoreAttention(MegatronModule):
    """Bidirectional `core_attention` for the vision tower: `scaled_dot_product_attention` over all patches."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.no_mask:
            raise ValueError(f"VisionCoreAttention is bidirectional (AttnMaskType.no_mask), got {attn_mask_type}.")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("VisionCoreAttention takes no mask, bias or packing: every patch sees every patch.")
        sq, b, n_heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (s, b, n, hn) -> (b, n, s, hn)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters


def vision_layer_spec():
    """A ViT layer: megatron-core's local ViT spec (LayerNorm, column/row-parallel linears) with bidirectional SDPA
    attention (the local spec's own mask type is causal, which a ViT is not)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    attention = spec.submodules.self_attention
    attention.params = {**(attention.params or {}), "attn_mask_type": AttnMaskType.no_mask}
    attention.submodules.core_attention = VisionCoreAttention
    return spec


def projector_spec():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


class VisionLanguageModel(GPTModel):
    """A GPTModel with a SigLIP tower and a projector in front of its embedding (see the module docstring)."""

    def __init__(self, *, vision: VisionShape, dtype: torch.dtype, on_cpu: bool, perform_initialization: bool,
                 **gpt_kwargs):
        super().__init__(**gpt_kwargs)
        self.vision = vision
        self.vision_model = self.vision_projection = None
        if not self.pre_process:
            return
        from megatron.core.models.vision.clip_vit_model import CLIPViTModel
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.transformer.identity_op import IdentityOp

        tp = self.config.tensor_model_parallel_size
        common = dict(tp=tp, dtype=dtype, on_cpu=on_cpu, perform_initialization=perform_initialization)
        pg = gpt_kwargs.get("pg_collection")
        self.vision_model = CLIPViTModel(
            vision_transformer_config(vision, **common), vision_layer_spec(), ln_post_impl=IdentityOp,
            add_class_token=False, class_token_len=0, patch_dim=vision.patch_size, img_h=vision.image_size,
            img_w=vision.image_size, model_subtype="siglip", pg_collection=pg)
        if vision.num_channels != 3:  # CLIPViTModel's convolution reads RGB
            raise ValueError(f"vision_config.num_channels={vision.num_channels}: only RGB (3) is supported.")
        self.vision_projection = MultimodalProjector(
            projector_transformer_config(vision, **common), projector_spec(), "mlp", vision.hidden_size,
            tp_group=pg.tp if pg is not None else None)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) images -> (N, tokens_per_image, text hidden) projected features."""
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
                self.vision.num_channels, self.vision.image_size, self.vision.image_size):
            v = self.vision
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: expected (N, {v.num_channels}, "
                             f"{v.image_size}, {v.image_size}) images, as the tower's config.json says.")
        conv = self.vision_model.conv1.weight
        features = self.vision_model(pixel_values.to(device=conv.device, dtype=conv.dtype))  # (N, P, H_vision)
        return self.vision_projection(features)  # (N, P, H_text)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
              image_features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder's input (S, B, H): token embeddings with the image features at the image-token positions.
        `image_features` (N, P, H): `image_embeddings(pixel_values)` computed before (a decode loop reuses them)."""
        text = self.embedding(input_ids=input_ids, position_ids=position_ids)  # (S, B, H)
        images = self.image_embeddings(pixel_values) if image_features is None else image_features  # (N, P, H)
        where = (input_ids == self.vision.image_token_id).nonzero()  # (N * P, 2) as (b, s), row by row
        if where.size(0) != images.size(0) * images.size(1):
            raise ValueError(f"{where.size(0)} image tokens (id {self.vision.image_token_id}) in input_ids but "
                             f"{images.size(0)} images x {images.size(1)} features: put tokens_per_image="
                             f"{self.vision.tokens_per_image} image tokens in the prompt for every image.")
        return text.index_put((where[:, 1], where[:, 0]), images.reshape(-1, images.size(-1)).to(text.dtype))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: Optional[torch.Tensor] = None, image_features: Optional[torch.Tensor] = None,
                **kwargs):
        if (pixel_values is not None or image_features is not None) and self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids, pixel_values, image_features)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)


def freeze_vision(chunks) -> int:
    """Stop gradients into the vision tower of every chunk (the projector and the text model keep training);
    returns how many parameters were frozen. Call before the chunks are wrapped in DDP."""
    from rlhf_mcore.models.hf_loader import unwrap_model

    frozen = 0
    for chunk in map(unwrap_model, chunks):
        if getattr(chunk, "vision", None) is None:
            raise ValueError("freeze_vision: the model has no vision tower (it is not a LLaVA model).")
        if chunk.vision_model is not None:
            for p in chunk.vision_model.parameters():
                p.requires_grad_(False)
                frozen += 1
    return frozen
