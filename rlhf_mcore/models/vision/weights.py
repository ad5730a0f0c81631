"""Which LLaVA tensors make each parameter of a vision-language chunk: the text model's rules renamed, and the
tower's and the projector's own.

The text model's parameters are the GPTModel's, so `weight_map.rule_for_param` describes them; their HF names
("model.layers.3...", "lm_head.weight") are then moved under the LLaVA checkpoint's text prefix. The checkpoint's
names are read from the checkpoint itself (`LlavaNames.detect`): transformers 5 saves `language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`; Hub checkpoints written by transformers 4 have
`vision_tower.vision_model.*`; in-memory names are `model.language_model.*`. An export writes the names it loaded,
so a round trip is bitwise in names too.

Tower (megatron-core's `CLIPViTModel`, SigLIP variant) and projector (`MultimodalProjector`, "mlp"):

    vision_model.conv1.{weight,bias}                     embeddings.patch_embedding.*      replicated
    vision_model.position_embeddings.weight              embeddings.position_embedding.*   replicated
    vision_model.decoder.layers.i.input_layernorm.*      encoder.layers.i.layer_norm1.*    replicated
      .self_attention.linear_qkv.{weight,bias}           self_attn.{q,k,v}_proj.*          qkv (one head per group)
      .self_attention.linear_proj.weight / .bias         self_attn.out_proj.*              col / replicated
      .pre_mlp_layernorm.*                               layer_norm2.*                     replicated
      .mlp.linear_fc1.{weight,bias}                      mlp.fc1.*                         row
      .mlp.linear_fc2.weight / .bias                     mlp.fc2.*                         col / replicated
    vision_projection.encoder.linear_fc1.{weight,bias}   multi_modal_projector.linear_1.*  row
    vision_projection.encoder.linear_fc2.weight / .bias  multi_modal_projector.linear_2.*  col / replicated

Tensors the forward never reads (tower layers after `vision_feature_layer`, `post_layernorm`, SigLIP's pooling
`head`) have no parameter: `passthrough_names` lists them and the exporter copies them from the source checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlhf_mcore.models.vision.config import VisionShape

_PATCH = "embeddings.patch_embedding.weight"
_EMBED = "embed_tokens.weight"
_PROJ = "multi_modal_projector.linear_1.weight"

# tower parameter (after "vision_model.") -> (kind, HF suffix after the tower prefix, sort position)
_TOWER = {
    "conv1.weight": ("replicated", "embeddings.patch_embedding.weight"),
    "conv1.bias": ("replicated", "embeddings.patch_embedding.bias"),
    "position_embeddings.weight": ("replicated", "embeddings.position_embedding.weight"),
}
_TOWER_LAYER = {
    "input_layernorm.weight": ("replicated", ("layer_norm1.weight",)),
    "input_layernorm.bias": ("replicated", ("layer_norm1.bias",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("col", ("self_attn.out_proj.weight",)),
    "self_attention.linear_proj.bias": ("replicated", ("self_attn.out_proj.bias",)),
    "pre_mlp_layernorm.weight": ("replicated", ("layer_norm2.weight",)),
    "pre_mlp_layernorm.bias": ("replicated", ("layer_norm2.bias",)),
    "mlp.linear_fc1.weight": ("row", ("mlp.fc1.weight",)),
    "mlp.linear_fc1.bias": ("row", ("mlp.fc1.bias",)),
    "mlp.linear_fc2.weight": ("col", ("mlp.fc2.weight",)),
    "mlp.linear_fc2.bias": ("replicated", ("mlp.fc2.bias",)),
}
_PROJECTOR = {
    "linear_fc1.weight": ("row", "linear_1.weight"),
    "linear_fc1.bias": ("row", "linear_1.bias"),
    "linear_fc2.weight": ("col", "linear_2.weight"),
    "linear_fc2.bias": ("replicated", "linear_2.bias"),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LlavaNames:
    """The prefixes of a LLaVA checkpoint's tensor names (see the module docstring)."""

    text: str = "language_model.model."  # + "embed_tokens.weight", "layers.N...", "norm.weight"
    lm_head: str = "language_model.lm_head.weight"
    tower: str = "vision_tower."  # + "embeddings...", "encoder.layers.N...", "post_layernorm..."
    projector: str = "multi_modal_projector."

    @classmethod
    def detect(cls, hf_dir) -> "LlavaNames":
        """The names the checkpoint in `hf_dir` uses; transformers 5's save layout when it holds no weights (a
        Megatron checkpoint's `hf_meta/`)."""
        from rlhf_mcore.models.safetensors_check import INDEX_FILE, model_weight_files

        hf_dir = Path(hf_dir)
        index = hf_dir / INDEX_FILE
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            from safetensors import safe_open

            names = []
            for f in model_weight_files(hf_dir):
                with safe_open(str(f), framework="pt") as handle:
                    names += list(handle.keys())
        if not names:
            return cls()

        def prefix(suffix: str, what: str) -> str:
            found = [n[: -len(suffix)] for n in names if n.endswith(suffix)]
            if len(found) != 1:
                raise ValueError(f"{hf_dir}: expected one tensor named *{suffix} ({what}), found {found or 'none'}; "
                                 "is this a LlavaForConditionalGeneration checkpoint?")
            return found[0]

        text = prefix(_EMBED, "the text embedding")
        head = "language_model.lm_head.weight" if text.startswith("language_model.") else "lm_head.weight"
        return cls(text=text, lm_head=head, tower=prefix(_PATCH, "the patch embedding"),
                   projector=prefix(_PROJ, "the projector") + "multi_modal_projector.")

    def text_name(self, name: str) -> str:
        """A causal LM's tensor name ("model.X", "lm_head.weight") -> this checkpoint's; a critic's head ("score.*")
        sits beside the LM head (a LLaVA checkpoint has none: the critic's head keeps its initialisation)."""
        if name == "lm_head.weight":
            return self.lm_head
        if name in ("score.weight", "score.bias"):
            return self.lm_head[: -len("lm_head.weight")] + name
        if not name.startswith("model."):
            raise ValueError(f"{name!r} is not a causal LM's tensor name (model.* or lm_head.weight)")
        return self.text + name[len("model."):]


def text_rule(rule, names: LlavaNames):
    """A text-model `WeightRule` with its HF names moved under the checkpoint's text prefix."""
    return dataclasses.replace(rule, hf_names=tuple(names.text_name(n) for n in rule.hf_names))


def vision_rule(name: str, names: LlavaNames):
    """The `WeightRule` of a tower or projector parameter `name` (a chunk's parameter name)."""
    from rlhf_mcore.models.weight_map import WeightRule

    if name.startswith("vision_projection.encoder."):
        suffix = name[len("vision_projection.encoder."):]
        if suffix in _PROJECTOR:
            kind, hf = _PROJECTOR[suffix]
            return WeightRule(f"projector.{suffix}", kind, (names.projector + hf,),
                              sort=(-1, 1, list(_PROJECTOR).index(suffix), 0))
    elif name.startswith("vision_model."):
        suffix = name[len("vision_model."):]
        if suffix in _TOWER:
            kind, hf = _TOWER[suffix]
            return WeightRule(f"vision.{suffix}", kind, (names.tower + hf,),
                              sort=(-1, 0, -1, list(_TOWER).index(suffix)))
        m = _LAYER_RE.match(suffix)
        if m and m.group(2) in _TOWER_LAYER:
            layer, rest = int(m.group(1)), m.group(2)
            kind, hf = _TOWER_LAYER[rest]
            return WeightRule(f"vision.layers.{layer}.{rest}", kind,
                              tuple(f"{names.tower}encoder.layers.{layer}.{s}" for s in hf),
                              sort=(-1, 0, layer, list(_TOWER_LAYER).index(rest)))
    raise ValueError(f"no HF mapping for vision-language parameter {name!r}")


def passthrough_names(vision: VisionShape, names: LlavaNames, checkpoint_names) -> list[str]:
    """The checkpoint's tower tensors that no parameter holds (unused by LLaVA's forward), in name order."""
    used = {f"{names.tower}{hf}" for _, hf in _TOWER.values()}
    used |= {f"{names.tower}encoder.layers.{i}.{s}" for i in range(vision.used_layers)
             for _, hfs in _TOWER_LAYER.values() for s in hfs}
    return sorted(n for n in checkpoint_names if n.startswith(names.tower) and n not in used)

