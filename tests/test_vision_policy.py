"""The vision-language policy (rlhf_mcore/models/vision/) against transformers' LlavaForConditionalGeneration, fp32.

A tiny LLaVA (SigLIP tower of 3 layers with its pooling head, features from layer -2, a 2-layer Qwen2, the locally
trained tokenizer with `<image>`) is built by `make_tiny_llava`. One 2-process launch (tests/scripts/vision_check.py)
runs the Megatron side at TP=1 (two data-parallel replicas), TP=2 and PP=2; pytest runs transformers here on the
same directory and compares:
- logits of a batch with images as a prefix and in the middle of a row, and of the documents packed as THD, 1e-5;
- the export: every checkpoint tensor bitwise, names included (the tensors no parameter holds carried through), and
  a saved directory that transformers loads to the same logits bitwise;
- gradients of every parameter of sum(logits * w), end to end and with `freeze_vision` (tower frozen, projector and
  text model train), 1e-5;
- where the tower lives at PP=2 (the first stage only), and a Megatron checkpoint saved at TP=2 loaded at PP=2;
- the colocated rollout (`vision.decode`): greedy and sampled action tokens and their log-probs;
- LLaVAs over Qwen3 and Llama 3 text models, and a checkpoint in transformers 4's names: logits and the export;
- the critic's Hugging Face export, loaded back as a critic and by transformers;
and in-process, the config errors (the key, the value, what is supported).
"""
import json
from pathlib import Path

import pytest
import torch
from launcher import CPU, run

pytestmark = pytest.mark.cost(30)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "vision_check.py"
ATOL = 1e-5
SEQ = 28
LAYOUTS = [dict(name="1x1", tp=1, pp=1, extras=["grads", "save_hf", "decode"]),
           dict(name="2x1", tp=2, pp=1, extras=["grads", "decode", "save_mcore", "critic_hf"]),
           dict(name="1x2", tp=1, pp=2, extras=["decode"], load_mcore="2x1")]
PAD = 3  # left padding of the second decode prompt
ACTIONS = 64  # the decode's action vocabulary: the last 64 ids


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from rlhf_mcore.models.vision.tiny import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(hf):
    """Row 0: image tokens first (a policy's prompt); row 1: text, the image, text. Two packed documents, each an
    image prefix and text. `weights` (B, S, V) of the gradient checks' loss."""
    cfg = hf.config
    n = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    size = cfg.vision_config.image_size
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 900, (2, SEQ), generator=g)
    ids[0, :n] = cfg.image_token_id
    ids[1, 5:5 + n] = cfg.image_token_id
    docs = [torch.cat([torch.full((n,), cfg.image_token_id), torch.randint(1, 900, (k,), generator=g)])
            for k in (6, 11)]
    vocab = cfg.text_config.vocab_size
    # decode prompts: an image prefix and an instruction; the second is shorter, left-padded
    prompts = [torch.cat([torch.full((n,), cfg.image_token_id), torch.randint(1, 900, (k,), generator=g)])
               for k in (6, 6 - PAD)]
    mask = torch.ones(2, n + 6, dtype=torch.bool)
    mask[1, :PAD] = False
    decode = {"ids": torch.stack([prompts[0], torch.cat([torch.zeros(PAD, dtype=torch.long), prompts[1]])]),
              "prompts": prompts, "prompt_mask": mask, "pixel_values": torch.randn(2, 3, size, size, generator=g),
              "new_tokens": 4, "token_range": (vocab - ACTIONS, vocab), "temperature": 1.3}
    return {"ids": ids, "pixel_values": torch.randn(2, 3, size, size, generator=g), "docs": docs,
            "doc_images": list(torch.randn(2, 3, size, size, generator=g)),
            "weights": torch.randn(2, SEQ, vocab, generator=g), "decode": decode}


@pytest.fixture(scope="module")
def other_dirs(tmp_path_factory):
    """{layout name: (directory the worker loads, directory transformers' reference loads)}: LLaVAs over the other
    text models the loader maps (Qwen3's q/k norms, Llama 3's rope scaling), and a checkpoint in transformers 4's
    names (the tower under `vision_tower.vision_model.`, as hub LLaVA checkpoints written by transformers 4 have it;
    the head untied, so `language_model.lm_head.weight` is read too) made by renaming a transformers-5 save."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlhf_mcore.models.vision.tiny import make_tiny_llava

    root = tmp_path_factory.mktemp("llava_text_models")
    dirs = {arch: (d, d) for arch in ("qwen3", "llama") for d in [make_tiny_llava(root / arch, text_arch=arch)]}
    untied = make_tiny_llava(root / "untied", tie_word_embeddings=False)
    t4 = root / "transformers4"
    shutil.copytree(untied, t4)
    tensors = load_file(str(untied / "model.safetensors"))
    assert "language_model.lm_head.weight" in tensors and "vision_tower.embeddings.patch_embedding.weight" in tensors
    save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}, str(t4 / "model.safetensors"), metadata={"format": "pt"})
    dirs["transformers4"] = (t4, untied)
    return dirs


OTHER_TP = {"qwen3": 2, "llama": 1, "transformers4": 2}


@pytest.fixture(scope="module")
def worker(llava_dir, other_dirs, batch, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision_worker")
    torch.save(batch, out / "batch.pt")
    others = [dict(name=name, tp=OTHER_TP[name], pp=1, model=str(d)) for name, (d, _) in other_dirs.items()]
    spec = {"model": str(llava_dir), "batch": str(out / "batch.pt"), "layouts": LAYOUTS + others}
    (out / "spec.json").write_text(json.dumps(spec))
    run(WORKER, "--spec", str(out / "spec.json"), "--out", str(out), nproc=2, timeout=600,
        env_extra={**CPU, "PYTHONWARNINGS": "ignore"})
    return json.loads((out / "results.json").read_text()), out


def hf_logits(hf, ids, pixel_values):
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixel_values).logits


@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_logits_match_transformers(worker, hf, batch, layout):
    """Mutations tried (each checked at TP=1 against the same transformers logits): image features scattered in
    (S, B) order instead of row by row (max error 8.4), causal attention in the tower (6.4), the tower's q and k
    swapped in the fused QKV map (7.5). The tower's `ln_post` kept as a LayerNorm fails earlier: the loader finds no
    HF tensor for it."""
    saved = torch.load(worker[1] / f"{layout}.pt")
    ref = hf_logits(hf, batch["ids"], batch["pixel_values"])
    err = (saved["logits"] - ref).abs().max().item()
    # ATOL per unit of the logits' scale: TP's split reductions reorder fp32 sums (TP=1 is bitwise here; at TP=2 the
    # transformers 5.25 tiny model's logits, |max| 7.7, differ by 1.4e-5 = 1.8e-6 relative)
    tol = ATOL * max(1.0, ref.abs().max().item())
    assert err < tol, f"{layout}: max |Megatron - transformers| = {err:.3g} (tolerance {tol:.3g})"
    if "packed" in saved:  # each document alone through transformers
        cu = saved["cu"].tolist()
        for doc, image, a, b in zip(batch["docs"], batch["doc_images"], cu[:-1], cu[1:]):
            want = hf_logits(hf, doc[None], image[None])[0]
            err = (saved["packed"][a:b] - want).abs().max().item()
            tol = ATOL * max(1.0, want.abs().max().item())
            assert err < tol, f"{layout} packed: max |Megatron - transformers| = {err:.3g} (tolerance {tol:.3g})"


@pytest.mark.parametrize("name", list(OTHER_TP))
def test_other_text_models_and_transformers4_names(worker, other_dirs, batch, name):
    """LLaVAs over a Qwen3 (TP=2: its q/k norms on split heads) and a Llama 3 (rope scaling) text model, and a
    checkpoint in transformers 4's names (TP=2), through the same loader: logits, padded and packed, equal
    transformers' on the reference directory within 1e-5 of their scale, and the export is bitwise under the
    checkpoint's own names. For the transformers-4 copy, transformers itself loads it to its source's logits
    bitwise, so the renamed file is one transformers reads, not one both sides misread alike.

    Mutations tried: the q/k norms dropped from the local layer spec (`qk_layernorm=False`): "qwen3" fails, max
    error 7.5 (and, since the loader refuses checkpoint tensors no parameter is made of, the load stops naming
    `q_norm` and `k_norm`); the checkpoint's tower prefix ignored (`LlavaNames.detect` keeping transformers 5's
    `vision_tower.`): the worker stops with "tensor 'vision_tower.embeddings.patch_embedding.weight' is not in the
    checkpoint"."""
    from transformers import LlavaForConditionalGeneration

    loaded, reference = other_dirs[name]
    hf = LlavaForConditionalGeneration.from_pretrained(reference, dtype=torch.float32).eval()
    ref = hf_logits(hf, batch["ids"], batch["pixel_values"])
    if loaded != reference:
        again = LlavaForConditionalGeneration.from_pretrained(loaded, dtype=torch.float32).eval()
        assert torch.equal(hf_logits(again, batch["ids"], batch["pixel_values"]), ref)
    saved = torch.load(worker[1] / f"{name}.pt")
    tol = ATOL * max(1.0, ref.abs().max().item())
    err = (saved["logits"] - ref).abs().max().item()
    assert err < tol, f"{name}: max |Megatron - transformers| = {err:.3g} (tolerance {tol:.3g})"
    cu = saved["cu"].tolist()
    for doc, image, a, b in zip(batch["docs"], batch["doc_images"], cu[:-1], cu[1:]):
        want = hf_logits(hf, doc[None], image[None])[0]
        err = (saved["packed"][a:b] - want).abs().max().item()
        assert err < ATOL * max(1.0, want.abs().max().item()), f"{name} packed: max error {err:.3g}"
    assert worker[0][name]["roundtrip"] == []


def test_critic_exports_as_a_llava_that_both_sides_load(worker, hf, batch):
    """The critic (TP=2, its head moved off the initialisation) saved as Hugging Face: the directory is a
    LlavaForConditionalGeneration with `score.*` beside the LM head; the critic built from it gives the same values
    bitwise, and transformers loads it as the LLaVA (the trunk, the tied LM head) with the source's logits bitwise.
    Mutation: the export naming the text model's Qwen2ForTokenClassification under model_type "llava" (as it did)
    -> the rebuild fails ("config.json of Qwen2ForTokenClassification lacks 'hidden_size'")."""
    from transformers import LlavaForConditionalGeneration

    saved = torch.load(worker[1] / "2x1.pt")
    out = worker[1] / "2x1_critic_hf"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlavaForConditionalGeneration"]
    assert saved["critic_values"].shape == (*batch["ids"].shape, 1)
    assert not torch.equal(saved["critic_values_trained"], saved["critic_values"])
    assert torch.equal(saved["critic_values_reloaded"], saved["critic_values_trained"])
    again = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(hf_logits(again, batch["ids"], batch["pixel_values"]),
                       hf_logits(hf, batch["ids"], batch["pixel_values"]))


def test_the_processor_makes_what_the_model_reads(llava_dir):
    """The tiny directory's LlavaProcessor expands `<image>` into tokens_per_image image tokens before the
    instruction and makes (1, 3, 16, 16) pixel values: a policy prompt in the layout the comparisons above use."""
    import numpy as np
    from transformers import AutoProcessor

    from rlhf_mcore.models import ModelShape

    vision = ModelShape.from_hf_dir(llava_dir).vision
    image = (np.random.default_rng(0).random((16, 16, 3)) * 255).astype(np.uint8)
    out = AutoProcessor.from_pretrained(llava_dir)(images=image, text="<image>Push the red block left.",
                                                    return_tensors="pt")
    ids = out["input_ids"][0]
    assert ids[:vision.tokens_per_image].eq(vision.image_token_id).all()
    assert ids.eq(vision.image_token_id).sum() == vision.tokens_per_image == 16
    assert out["pixel_values"].shape == (1, 3, 16, 16)


def test_images_change_the_logits(hf, batch):
    """The comparison above is not blind to the images: another image changes transformers' logits at and after the
    image tokens of that row."""
    other = batch["pixel_values"].clone()
    other[1] += 0.5
    diff = (hf_logits(hf, batch["ids"], other) - hf_logits(hf, batch["ids"], batch["pixel_values"])).abs()
    assert diff[0].max() == 0 and diff[1, 5:].max() > 1e-2


@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_hf_megatron_hf_roundtrip_is_bitwise(worker, layout):
    assert worker[0][layout]["roundtrip"] == []


def test_megatron_checkpoint_across_layouts(worker):
    """Saved at TP=2, loaded at PP=2: every parameter exports bitwise (the unread tower tensors are not in a Megatron
    checkpoint's weight-less hf_meta/, so they may be missing; nothing else is)."""
    assert worker[0]["1x2"]["from_mcore"] == []


def test_vision_tower_on_the_first_stage_only(worker):
    assert sorted(map(tuple, worker[0]["1x2"]["vision_on_stage"])) == [(0, True), (1, False)]
    assert all(held for _, held in worker[0]["2x1"]["vision_on_stage"])


def test_saved_directory_loads_with_transformers(worker, hf, batch, llava_dir):
    from transformers import LlavaForConditionalGeneration

    saved = worker[1] / "1x1_hf"
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlavaForConditionalGeneration"]
    assert (saved / "processor_config.json").is_file() and (saved / "tokenizer.json").is_file()
    loaded = LlavaForConditionalGeneration.from_pretrained(saved, dtype=torch.float32).eval()
    assert torch.equal(hf_logits(loaded, batch["ids"], batch["pixel_values"]),
                       hf_logits(hf, batch["ids"], batch["pixel_values"]))


@pytest.fixture(scope="module")
def hf_grads(hf, batch, llava_dir):
    """transformers' gradients of sum(logits * w), by checkpoint tensor name (None: not reached by the loss)."""
    from rlhf_mcore.models.vision.weights import LlavaNames

    names = LlavaNames.detect(llava_dir)
    hf.zero_grad(set_to_none=True)
    logits = hf(input_ids=batch["ids"], pixel_values=batch["pixel_values"]).logits
    (logits * batch["weights"]).sum().backward()
    prefixes = [("model.language_model.", names.text), ("model.vision_tower.", names.tower),
                ("model.multi_modal_projector.", names.projector)]
    out = {}
    for name, p in hf.named_parameters():
        for runtime, saved in prefixes:
            if name.startswith(runtime):
                out[saved + name[len(runtime):]] = None if p.grad is None else p.grad.clone()
    hf.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("layout", ["1x1", "2x1"])
def test_gradients_match_transformers(worker, hf_grads, layout):
    """End to end, every parameter's gradient is transformers' (the tower's too) within 1e-5 of the tensor's largest;
    with freeze_vision the tower has none and the projector's and text model's are unchanged. The tower's key bias has
    a zero gradient in exact arithmetic (softmax ignores a per-query constant; the text model's RoPE rotates its key
    bias, so there it is not zero): both sides must be rounding noise, under 1e-6 of the model's largest gradient.
    Mutation tried: freeze_vision a no-op (the tower's 27 tensors keep requires_grad: "the frozen tower has a
    gradient")."""
    saved = torch.load(worker[1] / f"{layout}.pt")
    scale = max(g.abs().max().item() for g in hf_grads.values() if g is not None)
    worst = 0.0
    for key in ("grads", "grads_frozen"):
        got = saved[key]
        assert got, key
        for name, grad in got.items():
            want = hf_grads[name]
            if key == "grads_frozen" and ".vision_tower." in f".{name}":
                assert grad is None, f"{layout} {name}: the frozen tower has a gradient"
                continue
            assert grad is not None and want is not None, f"{layout} {key} {name}"
            if ".vision_tower." in f".{name}" and name.endswith("self_attn.k_proj.bias"):
                assert max(grad.abs().max(), want.abs().max()) < 1e-6 * scale, f"{layout} {name} is not ~0"
                continue
            err = (grad - want).abs().max().item() / want.abs().max().item()
            worst = max(worst, err)
            assert err < ATOL, f"{layout} {key} {name}: relative error {err:.3g}"
        # what no parameter holds (the tower's last layer, post_layernorm, head) gets no gradient in transformers
        for name in set(hf_grads) - set(got):
            assert hf_grads[name] is None or not hf_grads[name].any(), name
    print(f"{layout}: largest relative gradient error {worst:.2g} (model's largest gradient {scale:.3g})")
    assert any(".vision_tower." in f".{n}" for n in saved["grads"]), "the tower's gradients were not compared"


def hf_action_logprobs(hf, prompt, image, tokens, lo, hi, temperature):
    """transformers' log-probs of `tokens` after `prompt` under the softmax over ids lo..hi-1 at `temperature`
    (teacher-forced, the row unpadded)."""
    ids = torch.cat([prompt, tokens])[None]
    logits = hf_logits(hf, ids, image[None])[0, len(prompt) - 1:-1, lo:hi]  # (n, K): the positions that chose
    return torch.log_softmax(logits / temperature, -1).gather(-1, (tokens - lo)[:, None])[:, 0]


@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_colocated_decode_matches_transformers(worker, hf, batch, layout):
    """Greedy: the tokens are transformers' argmax over the action ids step by step, and their log-probs (at T=1)
    transformers'; sampled at T=1.3: every token is an action id and its log-prob is transformers' under the
    tempered action softmax. The second row is left-padded. Mutations tried: the sampled index not shifted by the
    range's start (tokens outside the action ids: fails), the temperature left out of the returned log-probs
    (fails)."""
    saved = torch.load(worker[1] / f"{layout}.pt")
    d = batch["decode"]
    lo, hi = d["token_range"]
    tokens, logprobs = saved["greedy"]
    for row, (prompt, image) in enumerate(zip(d["prompts"], d["pixel_values"])):
        ids = prompt.clone()
        for _ in range(d["new_tokens"]):  # transformers' greedy decode over the action ids
            ids = torch.cat([ids, hf_logits(hf, ids[None], image[None])[0, -1, lo:hi].argmax()[None] + lo])
        assert tokens[row].tolist() == ids[len(prompt):].tolist(), f"{layout} row {row}"
        want = hf_action_logprobs(hf, prompt, image, tokens[row], lo, hi, 1.0)
        assert (logprobs[row] - want).abs().max() < ATOL, f"{layout} row {row}"
    tokens, logprobs = saved["sampled"]
    assert ((tokens >= lo) & (tokens < hi)).all()
    for row, (prompt, image) in enumerate(zip(d["prompts"], d["pixel_values"])):
        want = hf_action_logprobs(hf, prompt, image, tokens[row], lo, hi, d["temperature"])
        assert (logprobs[row] - want).abs().max() < ATOL, f"{layout} sampled row {row}"
    if layout != "1x1":  # the same generator state on every layout: the same samples
        assert torch.equal(tokens, torch.load(worker[1] / "1x1.pt")["sampled"][0])


# ------------------------------------------------------------------------------------------------------------
# config errors (in-process, no model built)


def _llava_config(llava_dir, **changes):
    cfg = json.loads((Path(llava_dir) / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition(".")
        (cfg[section] if section else cfg)[field] = value
    return cfg


@pytest.mark.parametrize("changes,message", [
    ({"vision_config.model_type": "clip_vision_model"}, "vision_config.model_type='clip_vision_model'"),
    ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer=[-2, -1]"),
    ({"vision_feature_layer": -4}, "select at least one"),
    ({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy='default'"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
    ({"text_config.model_type": "mistral"}, "text_config.model_type='mistral'"),
])
def test_unsupported_llava_configs_fail_with_the_key(llava_dir, changes, message):
    from rlhf_mcore.models import ModelShape, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelShape.from_config_dict(_llava_config(llava_dir, **changes))


def test_shape_and_layout_checks(llava_dir):
    from dataclasses import replace

    from rlhf_mcore.models import ModelShape
    from rlhf_mcore.models.hf_config import validate_parallel_layout
    from rlhf_mcore.models.pipeline_layout import PipelineLayoutError

    shape = ModelShape.from_hf_dir(llava_dir)
    assert shape.family == "qwen2" and shape.vision.used_layers == 2 and shape.vision.tokens_per_image == 16
    with pytest.raises(PipelineLayoutError, match="vision_config.num_attention_heads=4"):
        validate_parallel_layout(replace(shape, num_attention_heads=8, num_kv_heads=8), 8, 1, None)


def test_build_model_refuses_other_roles(llava_dir):
    """A LLaVA builds as actor, ref or critic (tests/test_vla_trainer.py: the VLA critic); not as a reward model."""
    from rlhf_mcore.models import build_model

    with pytest.raises(ValueError, match="role='reward'"):
        build_model(llava_dir, None, role="reward")


def test_text_trainer_refuses_a_llava_policy(llava_dir):
    """Until the VLA trainer feeds images, a LLaVA directory as the text trainer's model fails at config time with
    the key; its text model's layer count is what the pipeline-split check reads."""
    from rlhf_mcore.config import load_config, validate_config
    from rlhf_mcore.config.errors import ConfigError
    from rlhf_mcore.config.hf import model_num_layers

    assert model_num_layers(str(llava_dir)) == 2
    cfg = load_config(None, [f"actor_rollout_ref.model.path={llava_dir}"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path=.* is a LlavaForConditionalGeneration"):
        validate_config(cfg, 1)


@pytest.mark.parametrize("layout,want", [
    ("transformers4", ("language_model.model.", "language_model.lm_head.weight", "vision_tower.vision_model.",
                       "multi_modal_projector.")),
    ("in_memory", ("model.language_model.", "lm_head.weight", "model.vision_tower.", "model.multi_modal_projector.")),
])
def test_llava_names_are_read_from_the_checkpoint(tmp_path, layout, want):
    """Hub checkpoints written by transformers 4 and the in-memory names of transformers 5 (the tiny model above has
    transformers 5's saved names): the prefixes come from the checkpoint's index, and text names move under them."""
    from rlhf_mcore.models.vision.weights import LlavaNames

    text, head, tower, projector = want
    names = [f"{text}embed_tokens.weight", f"{text}layers.0.self_attn.q_proj.weight", head,
             f"{tower}embeddings.patch_embedding.weight", f"{tower}post_layernorm.weight",
             f"{projector}linear_1.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "x")}))
    got = LlavaNames.detect(tmp_path)
    assert (got.text, got.lm_head, got.tower, got.projector) == want
    assert got.text_name("model.layers.0.self_attn.q_proj.weight") == names[1]
    assert got.text_name("lm_head.weight") == head
