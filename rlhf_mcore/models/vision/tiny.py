"""A tiny LLaVA (`LlavaForConditionalGeneration`: a SigLIP tower, a tiny Qwen2, Qwen3 or Llama) for tests and CPU demos.

The directory loads like a real LLaVA checkpoint (`llava-hf/llava-interleave-qwen-0.5b-hf` has this shape, much
larger): `config.json`, `model.safetensors` (transformers' own initialisation, seeded), the tiny models' locally
trained byte-level BPE tokenizer (`models.tiny.train_tokenizer`) with an `<image>` special token appended, a
`LlavaProcessor` (SigLIP image processor) that expands `<image>` into `tokens_per_image` tokens, and the ChatML chat
template. By default the features come from the tower's second-to-last layer (`vision_feature_layer=-2`) and the
tower keeps SigLIP's pooling head, so a checkpoint holds tensors the forward never reads, as real ones do.
"""
from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"


def make_tiny_llava(out_dir, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    vocab: int = 1024, vision_hidden: int = 32, vision_layers: int = 3, vision_heads: int = 4,
                    image_size: int = 16, patch_size: int = 4, vision_feature_layer: int = -2,
                    vision_use_head: bool = True, tie_word_embeddings: bool = True, seed: int = 0,
                    init_std: float = 0.2, text_arch: str = "qwen2") -> Path:
    """Write a tiny random LLaVA directory to `out_dir` and return its path. Text: `make_tiny_model`'s model of the
    same arguments, a Qwen2 (`text_arch` "qwen3" or "llama" for those); tower: `vision_layers` SigLIP layers of width
    `vision_hidden` over `image_size`² RGB images in `patch_size`² patches (`(image_size / patch_size)²` image tokens
    per image)."""
    from transformers import (
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    from rlhf_mcore.models.tiny import ENDOFTEXT, IM_END, _build_config, default_tokenizer_vocab, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(default_tokenizer_vocab(vocab) - 1)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id, eot_id, im_end_id = tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, ENDOFTEXT, IM_END])
    text = _build_config(text_arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                         intermediate=2 * hidden, head_dim=hidden // heads, tie=tie_word_embeddings, bos_id=eot_id,
                         eos_id=im_end_id, pad_id=eot_id, dtype="float32", max_position_embeddings=4096)
    text.initializer_range = init_std
    tower = SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                               num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
                               image_size=image_size, patch_size=patch_size, vision_use_head=vision_use_head)
    tokens_per_image = (image_size // patch_size) ** 2
    cfg = LlavaConfig(text_config=text, vision_config=tower, image_token_id=image_id,
                      vision_feature_layer=vision_feature_layer, vision_feature_select_strategy="full",
                      image_seq_length=tokens_per_image, projector_hidden_act="gelu",
                      tie_word_embeddings=tie_word_embeddings)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    _spread_vision_weights(model, init_std, seed)
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=[im_end_id, eot_id],
                                               pad_token_id=eot_id, do_sample=False)
    model.save_pretrained(out)
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessor(size={"height": image_size, "width": image_size}), tokenizer=tokenizer,
        patch_size=patch_size, vision_feature_select_strategy="full", image_token=IMAGE_TOKEN,
        num_additional_image_tokens=0, chat_template=tokenizer.chat_template)
    processor.save_pretrained(out)
    return out


def _spread_vision_weights(model, std: float, seed: int) -> None:
    """Redraw the tower's and the projector's weights at `std` (transformers initialises SigLIP's linears with a
    tiny variance and its norms at one, so a tiny tower would barely change its input): every tensor, norms and
    biases included, becomes N(0, std²) around its init, so a wrong weight mapping shows in the logits."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)
