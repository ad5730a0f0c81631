"""CUDA graphs of a model chunk's transformer layers for packed micro-batches: the host cost of small
micro-batches, gone.

Without Transformer Engine, one Megatron layer is ~100 small kernels forward and backward, each launched from
Python (linear layers' autograd functions, norms, the fused SwiGLU/RoPE kernels, Flash Attention). At 0.5B with
4 x 1,024-token micro-batches the host needs ~90 ms a micro-batch against ~32 ms of GPU work: the GPU waits.
Here the whole decoder (every layer of the chunk and the final norm) of one packed micro-batch is one CUDA
graph forward and one backward (`torch.cuda.make_graphed_callables`); embedding, LM head and loss stay eager.

Static shapes: a graph replays fixed addresses and sizes, so the engine pads each micro-batch of a call to one
shape (:func:`static_shape`): `tokens` on a coarse ladder (at most 1/8 of padding), `max_seqlen` the call's longest
document rounded up to a power of two, and the document count (`cu_seqlens` entries) to a multiple of 8: the
padding tokens form dummy documents of at most `max_seqlen` tokens each, then zero-length ones fill the count. A
static `max_seqlen` near the real documents' lengths matters: Flash Attention's varlen kernels launch a grid of
ceil(max_seqlen / 128) blocks per document and head, and with `max_seqlen` = the packed length (16k) and 48
documents of ~350 tokens, 42 of every 43 blocks launch only to return at once, in every layer, forward and
backward. A call whose shape a captured graph holds with at most a quarter more tokens reuses that graph. Graphs
are cached by shape (least recently used out after `max_graphs`), one pool per chunk shared by all of them: the
schedule without pipelining runs each micro-batch's forward and backward back to back, so no two graphs' working
memory is live at once. Besides the shared pool each training graph keeps its own output buffers, among them one
for the parameters' gradients (the parameters' size again): at most `max_graphs` (4) of them.

Where graphs apply (:func:`graphs_supported`): CUDA, packed sequences, one pipeline stage and no virtual
stages, TP = CP = 1, no activation recompute, no dropout. Left unset (`cuda_graphs: null`), the engine graphs
only calls whose micro-batches hold at most `AUTO_MAX_TOKENS` tokens (the host-bound ones); `true` graphs all.

Between replays the decoder's inputs change only in content: hidden states, the RoPE frequency table and
`cu_seqlens` are copied into the graph's static inputs. Parameters are read in place (the training graph takes
them as explicit inputs, see :meth:`DecoderGraphs._capture`); a replay first checks that they have not moved and
recaptures if they have. The engine drops the graphs on every offload, which also returns their memory to the
rollout.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Optional

import torch

__all__ = ["AUTO_MAX_TOKENS", "DecoderGraphs", "graphs_supported", "static_shape", "token_bucket", "seqlen_bucket",
           "dummy_documents"]

DOC_MULTIPLE = 8
# set on the PackedSeqParams of a micro-batch padded to a static shape (packing.build_model_inputs): the calls the
# dispatcher sends through graphs
STATIC_FLAG = "rlhf_static_shape"
# `cuda_graphs` unset: graphs for calls whose micro-batches hold at most this many tokens. Below it a micro-batch's
# GPU work is shorter than Megatron's host time for it (0.5B at 4 x 1,024 tokens: ~32 ms against ~90 ms); above it
# the GPU is the bound, graphs gain nothing, and every new shape costs a capture (measured in TRL's GRPO step with
# 16k-24k-token micro-batches and the graphs dropped at each offload: update 1.10-1.40 s graphed, 0.99-1.04 eager).
# Open question (BENCHMARKS.md, round 5, session 20): the 0.5B configs no longer offload, so graphs would now
# persist between steps, and the PPO step's 16k-token micro-batches at 0.5B measured host-bound (the critic's GPU
# idle 35% of its update); `cuda_graphs: true` against this rule is the next measurement.
AUTO_MAX_TOKENS = 8192
REUSE_SLACK = 1.25  # a captured graph serves shapes down to 1/1.25 of its tokens (DecoderGraphs.reuse)


def token_bucket(n: int) -> int:
    """`n` rounded up on a ladder of 8 steps an octave (multiples of 128 below 1,024): few distinct shapes, at
    most 1/8 of padding."""
    n = max(int(n), 1)
    step = max(128, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


MIN_MAX_SEQLEN = 128  # Flash Attention's block of query rows: a smaller static max_seqlen launches no fewer blocks


def seqlen_bucket(longest: int, tokens: int) -> int:
    """A graph's static `max_seqlen`: the longest document rounded up to a power of two (at least
    `MIN_MAX_SEQLEN`), at most the packed length `tokens`."""
    return min(max(MIN_MAX_SEQLEN, 1 << (max(int(longest), 1) - 1).bit_length()), int(tokens))


def dummy_documents(pad: int, max_seqlen: int) -> int:
    """How many dummy documents `pad` padding tokens take, none longer than `max_seqlen` (at least one: the static
    document count keeps room for it)."""
    return max(1, -(-int(pad) // int(max_seqlen)))


def fits(shape: tuple[int, int, int], totals: list[int], docs: list[int], longest: int) -> bool:
    """Whether every micro-batch (its token total and document count) fits the static `shape` (tokens, documents,
    max_seqlen): its tokens, its longest document, and its documents plus the dummies its padding needs."""
    tokens, slots, max_seqlen = shape
    return (max(totals) <= tokens and longest <= max_seqlen
            and all(d + dummy_documents(tokens - t, max_seqlen) <= slots for t, d in zip(totals, docs)))


def static_shape(totals: list[int], docs: list[int], longest: int) -> tuple[int, int, int]:
    """The (tokens, documents, max_seqlen) every micro-batch of a call is padded to: the largest total on the
    ladder (:func:`token_bucket`), the longest document on :func:`seqlen_bucket`, and room for each micro-batch's
    documents plus the dummies its padding needs (:func:`dummy_documents`), rounded up to a multiple of 8."""
    tokens = token_bucket(max(totals))
    max_seqlen = seqlen_bucket(longest, tokens)
    need = max(d + dummy_documents(tokens - t, max_seqlen) for t, d in zip(totals, docs))
    return tokens, -(-need // DOC_MULTIPLE) * DOC_MULTIPLE, max_seqlen


def graphs_supported(config, state, chunks: int, packed: bool) -> Optional[str]:
    """Why CUDA graphs cannot run for this model and layout, or None when they can."""
    if state.device.type != "cuda":
        return f"the model is on {state.device.type} (CUDA graphs need a CUDA device)"
    if not packed:
        return "sequences are padded, not packed (model.use_remove_padding=false)"
    if state.dims.pp > 1 or chunks > 1:
        return (f"pipeline parallelism (PP={state.dims.pp}, {chunks} virtual stages): several micro-batches are in "
                "flight at once, each graph holds one")
    if state.dims.tp > 1 or getattr(config, "context_parallel_size", 1) > 1:
        return "TP or CP > 1 (collectives inside the layers are not verified under capture)"
    if getattr(config, "num_moe_experts", None):
        return ("a mixture-of-experts model (its experts' token groups change size with the routing, and routing "
                "replay sets each micro-batch's routes)")
    if getattr(config, "recompute_granularity", None):
        return ("activation recompute (enable_gradient_checkpointing, or override_transformer_config."
                "recompute_granularity) re-runs layers or modules in the backward")
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        return "dropout > 0"
    return None


class _DecoderCall(torch.nn.Module):
    """The decoder as a function of tensors only (what a graph capture takes). Training graphs call it through
    `torch.func.functional_call` with aliases of the parameters (:meth:`DecoderGraphs._capture` says why)."""

    def __init__(self, decoder: torch.nn.Module, eager_forward, max_seqlen: int):
        super().__init__()
        self.decoder = decoder
        self._eager = eager_forward
        self.max_seqlen = max_seqlen

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        from megatron.core.packed_seq_params import PackedSeqParams

        from rlhf_mcore.models.rope import clear_packed_tables

        clear_packed_tables()  # the RoPE tables are computed inside the graph, from its static cu_seqlens
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.max_seqlen,
                                 max_seqlen_kv=self.max_seqlen)
        out = self._eager(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=params)
        clear_packed_tables()
        return out


class DecoderGraphs:
    """Replaces `chunk.decoder.forward` with a dispatcher: inside :meth:`active`, a packed call of a static
    shape replays (capturing on first sight) a CUDA graph; every other call runs the decoder eagerly."""

    def __init__(self, chunk: torch.nn.Module, max_graphs: int = 4, warmup_iters: int = 2, required: bool = False,
                 key: str = "megatron.cuda_graphs"):
        self.required, self.key = required, key  # required: a failed capture is an error, else eager from then on
        self.failed: Optional[str] = None
        self.decoder = chunk.decoder
        self._eager = self.decoder.forward
        self.decoder.forward = self._dispatch
        self.max_graphs, self.warmup_iters = max_graphs, warmup_iters
        self._graphs: OrderedDict = OrderedDict()  # (tokens, cu entries, max_seqlen, grad) -> graphed callable
        self._names = [n for n, _ in self.decoder.named_parameters()]
        self._params = [p for _, p in self.decoder.named_parameters()]
        self._ptrs: tuple = ()  # the parameters' addresses the graphs read
        self._pool = None
        self._active = False
        self.captures = 0  # graphs captured so far (a metric: recaptures every step mean the shapes vary)

    def active(self):
        """Context in which packed calls of static shape go through graphs (the engine's update/scoring)."""
        graphs = self

        class _Active:
            def __enter__(self):
                graphs._active = True

            def __exit__(self, *exc):
                graphs._active = False

        return _Active()

    def reset(self) -> None:
        """Drop every graph and its memory (parameters moved, or the rollout needs the memory)."""
        self._graphs.clear()
        self._pool = None
        self._ptrs = ()

    def __len__(self) -> int:
        return len(self._graphs)

    def reuse(self, shape: tuple[int, int, int], grad: bool, totals: list[int], docs: list[int],
              longest: int) -> tuple[int, int, int]:
        """`shape` (tokens, documents, max_seqlen), or the smallest captured shape of this grad mode that holds the
        call's micro-batches (:func:`fits`) with at most `REUSE_SLACK` more tokens: padding a little more costs
        less than another capture and its memory."""
        tokens = shape[0]
        held = [(t, cu - 1, m) for t, cu, m, g in self._graphs
                if g == grad and tokens <= t <= tokens * REUSE_SLACK and fits((t, cu - 1, m), totals, docs, longest)]
        return min(held) if held else shape

    def _dispatch(self, hidden_states, attention_mask=None, *args, rotary_pos_emb=None, packed_seq_params=None,
                  **kwargs):
        if (not self._active or self.failed or args or attention_mask is not None or packed_seq_params is None
                or packed_seq_params.qkv_format != "thd" or rotary_pos_emb is None
                or any(v is not None for v in kwargs.values())
                or not getattr(packed_seq_params, STATIC_FLAG, False)):
            return self._eager(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=packed_seq_params, **kwargs)
        cu = packed_seq_params.cu_seqlens_q
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            p.requires_grad for p in self.decoder.parameters()))
        key = (hidden_states.size(0), cu.numel(), int(packed_seq_params.max_seqlen_q), grad)
        if self._graphs and tuple(p.data_ptr() for p in self._params) != self._ptrs:
            self.reset()  # parameters moved (e.g. loaded or offloaded without reset): the graphs read old addresses
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(key, hidden_states, rotary_pos_emb, cu)
            except Exception as e:  # an op that cannot be captured on this setup (a custom kernel, an allocator mode)
                if self.required:
                    raise RuntimeError(f"{self.key}=true, but capturing the decoder as a CUDA graph failed: {e!r}. "
                                       f"Set {self.key}=false to train without graphs") from e
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.reset()
                warnings.warn(f"{self.key} unset: capturing the decoder as a CUDA graph failed ({self.failed}); "
                              f"training on without graphs. Set {self.key}=false to skip the attempt", stacklevel=2)
                return self._eager(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        self._graphs.move_to_end(key)
        if grad:
            return graph(hidden_states, rotary_pos_emb, cu, *self._params)
        return graph(hidden_states, rotary_pos_emb, cu)

    def _capture(self, key, hidden, rotary, cu):
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        call = _DecoderCall(self.decoder, self._eager, key[2])
        sample = (hidden.detach().clone().requires_grad_(hidden.requires_grad), rotary.detach().clone(),
                  cu.detach().clone())
        if key[3]:
            # The parameters enter the graph as explicit inputs, through aliases (same storage): Megatron's DDP
            # created the parameters' gradient accumulators on the default stream, and autograd would make that
            # stream wait on the capturing one ("operation would make the legacy stream depend on a capturing
            # blocking stream"). The aliases' accumulators are made during the warm-up, on its side stream; the
            # replay passes the real parameters, whose gradients then reach DDP's hooks as in eager mode.
            aliases = tuple(p.detach().requires_grad_(p.requires_grad) for p in self._params)
            names = ["decoder." + n for n in self._names]

            def decoder_fn(hidden, rotary, cu, *params):
                return torch.func.functional_call(call, dict(zip(names, params)), (hidden, rotary, cu))

            graphed = torch.cuda.make_graphed_callables(decoder_fn, sample + aliases,
                                                        num_warmup_iters=self.warmup_iters, pool=self._pool,
                                                        allow_unused_input=True)
        else:
            graphed = _forward_graph(call, sample, self.warmup_iters, self._pool)
        self._ptrs = tuple(p.data_ptr() for p in self._params)
        self._graphs[key] = graphed
        self.captures += 1
        return graphed


def _forward_graph(call: torch.nn.Module, sample: tuple, warmup_iters: int, pool):
    """A forward-only graph (no autograd): static inputs in, the static output back (a view valid until the
    next replay)."""
    static_in = sample
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup_iters):
            call(*static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
        static_out = call(*static_in)

    def replay(*inputs):
        for s, x in zip(static_in, inputs):
            if s.data_ptr() != x.data_ptr():
                s.copy_(x)
        graph.replay()
        return static_out.detach()

    return replay
