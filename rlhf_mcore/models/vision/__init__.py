"""Vision-language policies: a LLaVA model (SigLIP tower, projector, text model) in the Megatron stack.

    config   LLaVA config.json -> VisionShape; the tower's and the projector's TransformerConfigs
    model    VisionLanguageModel (a GPTModel with the tower and projector on its first stage), freeze_vision
    weights  LLaVA tensor names <-> the chunk's parameters (TP shards), tensors carried through unchanged
    tiny     make_tiny_llava: a tiny random LLaVA directory for tests

`build_model` builds these chunks from a LLaVA directory; the loader and the exporter handle them like any other.
Nothing is imported here: `config` must stay importable without torch or megatron.
"""
