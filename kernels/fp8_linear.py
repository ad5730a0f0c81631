"""A linear layer whose three GEMMs run in FP8 with current scaling (no Transformer Engine), in one of two recipes.

"rowwise" (the default, `fp8_linear_train`):
    y = x @ W.T          x per token (row), W per output channel, both e4m3
    dx = dy @ W          dy per token in `grad_dtype` (e4m3 or e5m2), W per input channel (its columns), e4m3
    dW = dy.T @ x        dy per output channel (its columns), x per input channel (its columns)

Every operand is quantized along the GEMM's output dimension, so each scale is a row-wise scale of
`torch._scaled_mm` (one per row of the left operand, one per column of the right one) and the scales factor out
of the K sum exactly. The operands are kept in their original dtype between forward and backward (re-quantized
along the other axis there, by `fp8.quantize_cols_t`, which writes the transposed codes without a bf16 transpose
copy), so activation memory is what a bf16 linear keeps.

"delayed" (`ActivationAmaxes`): the tensorwise recipe with x's and dy's scales from the amaxes of earlier optimizer
steps (Transformer Engine's DelayedScaling, amax_compute_algo "max"), so their casts read each tensor once (the cast
folds the tensor's amax into the history from the same read) instead of twice; W keeps its exact amax.

"tensorwise" (`fp8_linear_train_tensorwise`, Transformer Engine's per-tensor scaling, with current amaxes): x, W and
dy each have one scale, so one set of codes serves both axes. Each tensor is read once for its amax and once by
one kernel that writes its codes and their transpose (`fp8.quantize_tensor`), against two quantizations (four
reads) per tensor rowwise; cuBLAS's tensor-wise FP8 GEMM ran 1.66x bf16 against row-wise 1.57x at the 7B MLP
shape (DESIGN.md). The forward keeps the transposed codes of x and W for the backward (1 byte an element, against
the 2 of the bf16 x the rowwise recipe keeps). W's amax is kept between calls and recomputed when W changes
(`WeightAmax`: invalidated by the train engine after each optimizer step and load, and on a new storage or version
counter); a CUDA graph capture computes it inside the graph, so replays after an optimizer step never use a stale
one. The cost is
range: a token's values share the tensor's scale, so values below amax * 2**-9 / 448 (e4m3) flush to zero, which
is why Transformer Engine pairs it with e5m2 gradients ("hybrid").

Master weights, gradients and the optimizer stay as they are (fp32 main params under Megatron's optimizer). On CPU
the GEMMs are the dequantized fp32 reference (`fp8.reference_mm`): slow, for tests only. cuBLAS wants every FP8
GEMM dim a multiple of 16: the token rows are zero-padded (zeros add nothing to dW).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fp8 import E4M3, E5M2, quantize_cols_t, quantize_rows, quantize_tensor, reference_mm, tensor_amax, transpose_codes

GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
RECIPES = ("rowwise", "tensorwise", "delayed")
PER_TENSOR = ("tensorwise", "delayed")  # the recipes of `fp8_linear_train_tensorwise`
_ALIGN = 16


def scaled_mm_rows(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b.T for b (N, K), each quantized per row (its GEMM output dim): (M, N) in out_dtype."""
    return _mm(*quantize_rows(a, a_dtype), *quantize_rows(b, b_dtype), out_dtype)


def _mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
        ) -> torch.Tensor:
    """Codes aq (M, K) @ bq.T for bq (N, K), row scales sa (M, 1) and sb (N, 1): (M, N) in out_dtype."""
    if aq.is_cuda:
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t().contiguous(), out_dtype=out_dtype)
    return reference_mm(aq, sa, bq, sb).to(out_dtype)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % _ALIGN
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ weight.T (+ bias) for x (M, K); see the module docstring. dgrad_group: all-reduce dx over it
    (a column-parallel layer's input gradient under tensor parallelism)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, dgrad_group, fuse_wgrad=False):
        m = x.shape[0]
        xp = _pad_rows(x)
        y = scaled_mm_rows(xp, weight, E4M3, E4M3, x.dtype)[:m]
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xp, weight)
        ctx.m, ctx.has_bias, ctx.grad_dtype, ctx.group = m, bias is not None, grad_dtype, dgrad_group
        ctx.fuse_wgrad = fuse_wgrad
        return y

    @staticmethod
    def backward(ctx, dy):
        xp, weight = ctx.saved_tensors
        dyp = _pad_rows(dy.contiguous())
        # dx = dy @ W: dy per token, W.T per row (W's input channels)
        dx = _mm(*quantize_rows(dyp, ctx.grad_dtype), *quantize_cols_t(weight, E4M3), xp.dtype)[:ctx.m]
        if ctx.group is not None:
            dist.all_reduce(dx, group=ctx.group)
        dw = None
        if weight.requires_grad:
            # dW = dy.T @ x: both per channel (their columns); e5m2 x e5m2 has no FP8 GEMM, x stays e4m3
            operands = (*quantize_cols_t(dyp, ctx.grad_dtype), *quantize_cols_t(xp, E4M3))
            dw = _accumulated(weight, operands, xp.dtype) if ctx.fuse_wgrad else _mm(*operands, weight.dtype)
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None


def fp8_linear_train(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     grad_dtype: torch.dtype = E4M3, dgrad_group=None, fuse_wgrad: bool = False) -> torch.Tensor:
    """x (..., K) @ weight.T (+ bias) with FP8 GEMMs forward and backward; (..., N). fuse_wgrad: the weight
    gradient is accumulated into `weight.main_grad` (`_accumulated`)."""
    lead = x.shape[:-1]
    y = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, grad_dtype, dgrad_group, fuse_wgrad)
    return y.reshape(*lead, weight.shape[0])


def _accumulated(weight: torch.Tensor, operands: tuple, dtype: torch.dtype) -> torch.Tensor | None:
    """The gradient-accumulation fusion: main_grad += the weight-gradient GEMM of `operands` (codes and scales of
    dy.T and x.T, `fp8_wgrad.wgrad_accumulate`); returns what Megatron's fused linears return in its place (an
    uninitialised tensor of main_grad's shape, with `grad_added_to_main_grad` set, so its DDP hook adds nothing; None
    for a weight outside Megatron's DDP)."""
    from .fp8_wgrad import wgrad_accumulate

    wgrad_accumulate(*operands, weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return torch.empty(weight.main_grad.shape, dtype=dtype, device=weight.main_grad.device)


# ------------------------------------------------------------------------------------------------ tensorwise


class WeightAmax:
    """max |W| of one weight, kept between calls: recomputed after `invalidate()` (the train engine calls it after
    every optimizer step, checkpoint load and offload: Megatron's optimizer writes bf16 weights through its parameter
    buffer, which leaves the parameter's version counter where it was), when W's storage or version counter moved
    (in-place writes through the parameter itself, an offload's new storage), and inside every CUDA graph capture (a
    replay then recomputes it, since the graph cannot see any of this).

    keep_codes: W's FP8 codes and their transpose are kept under the same rules (`codes`), as Transformer Engine keeps
    a weight's FP8 copy across micro-batches: W is then cast once per optimizer step instead of in every forward
    (each micro-batch, and both passes of a recomputed one), for 2 bytes a parameter held until `invalidate()`.
    keep_codes="forward": only the codes are kept (1 byte a parameter); a forward that needs the transpose (one per
    micro-batch) copies it from them (`transpose_codes`: 2 bytes an element moved, against the 7 of casting W in
    both passes of a recomputed micro-batch), for updates whose memory cannot hold both."""

    def __init__(self, keep_codes: bool | str = False):
        if keep_codes not in (False, True, "forward"):
            raise ValueError(f"keep_codes={keep_codes!r}: False, True or 'forward'")
        self.keep_codes = keep_codes
        self.amax: torch.Tensor | None = None
        self.kept: tuple | None = None  # (codes, scale, transposed codes) of W under `key`, with keep_codes
        self.key: tuple[int, int] | None = None
        self.computed = 0  # how many times the amax was recomputed (tests)
        self.cast = 0  # how many times kept codes were cast (tests)

    def invalidate(self) -> None:
        self.amax = self.key = self.kept = None

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return tensor_amax(weight)
        key = (weight.data_ptr(), weight._version)
        if self.amax is None or key != self.key or self.amax.device != weight.device:
            self.amax, self.key, self.kept = tensor_amax(weight.detach()), key, None
            self.computed += 1
        return self.amax

    def codes(self, weight: torch.Tensor, transpose: bool) -> tuple:
        """W's e4m3 codes under its amax: (codes, scale, transposed codes if `transpose` else None), as
        `quantize_tensor`; kept between calls with keep_codes (outside CUDA graph capture)."""
        amax = self(weight)
        if not self.keep_codes or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return quantize_tensor(weight, E4M3, amax=amax, transpose=transpose)
        if self.kept is None:
            self.kept = quantize_tensor(weight.detach(), E4M3, amax=amax, transpose=self.keep_codes is True)
            self.cast += 1
        q, scale, q_t = self.kept
        if transpose and q_t is None:  # keep_codes="forward"
            q_t = transpose_codes(q)
        return q, scale, q_t if transpose else None


class ActivationAmaxes:
    """Delayed scaling of the activations' and gradients' FP8 casts (the "delayed" recipe) for `sites` tensors of a
    model chunk (two per linear: its input x and its output gradient dy): each site's scale comes from the largest
    amax it saw over its last `history` optimizer steps (Transformer Engine's DelayedScaling with
    amax_compute_algo="max"; Megatron's fp8_amax_history_len), values beyond it saturate at the format's largest
    code. The cast kernel folds the tensor's own max |x| into `seen` from the read that casts it, so a cast reads its
    tensor once instead of twice (current scaling reads it once for the amax first).

    `roll()` (the train engine, after each optimizer step) pushes each site's `seen` into its history and sets the
    scales' `amax` to the history's maximum; a site that saw nothing (or only non-finite values: a skipped step's
    overflow) keeps its history. Between rolls the scales stay fixed, so a recomputed forward writes the same codes
    as its first pass, whatever the schedule. A site's first cast ever has no history: it runs with current scaling
    and primes the site with its amax (outside CUDA graph capture: a graph captured before a site's first eager cast
    keeps current scaling for that site, correct and no faster; the engine's graphs warm up eagerly first).
    All state is on the device (no host synchronisation, graph replays read it in place); `state_dict` for
    checkpoints."""

    def __init__(self, sites: int, history: int, device):
        if history < 1:
            raise ValueError(f"fp8 amax history of {history} steps: it must be >= 1")
        f32 = {"dtype": torch.float32, "device": device}
        self.hist = torch.zeros(sites, history, **f32)  # newest first
        self.amax = torch.zeros(sites, **f32)           # the scales' amaxes: max over hist
        self.seen = torch.zeros(sites, **f32)           # max |x| per site since the last roll
        self.primed = [False] * sites
        self.used = 0

    def sites(self, n: int = 2) -> tuple[int, ...]:
        """`n` new site indices (a linear takes two: x, dy)."""
        if self.used + n > len(self.primed):
            raise ValueError(f"ActivationAmaxes holds {len(self.primed)} sites; {self.used + n} requested")
        self.used += n
        return tuple(range(self.used - n, self.used))

    def scale_of(self, site: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(amax (0-dim), seen (1,)) of a primed site: what a cast under its delayed scale reads and folds into (a
        producer that writes codes itself, `fp8_mlp`); None before the site's first cast."""
        return (self.amax[site], self.seen[site:site + 1]) if self.primed[site] else None

    def quantize(self, site: int, x: torch.Tensor, dtype: torch.dtype, transpose: bool) -> tuple:
        """`quantize_tensor(x, dtype, transpose=transpose)` under the site's delayed scale (its first time: x's own
        amax), with x's max |x| folded into the site's `seen`."""
        seen = self.seen[site:site + 1]
        if self.primed[site]:
            return quantize_tensor(x, dtype, amax=self.amax[site], transpose=transpose, seen=seen)
        amax = tensor_amax(x)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.amax[site:site + 1].copy_(amax.float().reshape(1))
            self.primed[site] = True
        return quantize_tensor(x, dtype, amax=amax, transpose=transpose, seen=seen)

    @torch.no_grad()
    def roll(self) -> None:
        seen = torch.nan_to_num(self.seen, nan=0.0, posinf=0.0)
        pushed = torch.cat([seen[:, None], self.hist[:, :-1]], dim=1)
        self.hist.copy_(torch.where((seen > 0)[:, None], pushed, self.hist))
        newest = self.hist.amax(dim=1)
        self.amax.copy_(torch.where(newest > 0, newest, self.amax))
        self.seen.zero_()

    def state_dict(self) -> dict:
        return {"hist": self.hist.cpu(), "amax": self.amax.cpu(), "seen": self.seen.cpu(),
                "primed": torch.tensor(self.primed)}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["hist"].shape) != tuple(self.hist.shape):
            raise ValueError(f"FP8 amax history of shape {tuple(state['hist'].shape)} (sites, steps) in the "
                             f"checkpoint, {tuple(self.hist.shape)} here: the model or fp8_amax_history_len differs")
        for name in ("hist", "amax", "seen"):
            getattr(self, name).copy_(state[name])
        self.primed = [bool(v) for v in state["primed"].tolist()]


class DelayedSites:
    """One linear's two sites of an `ActivationAmaxes`: its input x (forward) and its output gradient dy."""

    def __init__(self, amaxes: ActivationAmaxes):
        self.amaxes = amaxes
        self.x, self.dy = amaxes.sites(2)


def _mm_tensorwise(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
                   ) -> torch.Tensor:
    """Codes aq (M, K) @ bq.T for bq (N, K) row-major, one scale each ((1, 1) fp32): (M, N) in out_dtype."""
    if aq.is_cuda:
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return reference_mm(aq, sa, bq, sb).to(out_dtype)


class Fp8TensorwiseLinearFunction(torch.autograd.Function):
    """y = x @ weight.T (+ bias) for x (M, K) under per-tensor scales (see the module docstring); weight_amax: the
    weight's `WeightAmax`; dgrad_group as in Fp8LinearFunction; backward: whether autograd will call backward
    (decided by the caller: inside forward grad mode is always off); delayed: the layer's `DelayedSites` (the
    "delayed" recipe) or None (current scaling)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, dgrad_group, weight_amax, backward, fuse_wgrad=False,
                delayed=None):
        m = x.shape[0]
        xp = _pad_rows(x)
        # a forward under no_grad (the first pass of activation recompute, log-probs) writes no transposes; the
        # recompute pass then writes the same codes (the same amaxes of the same tensors) and the transposes
        xq, xs, xq_t = (quantize_tensor(xp, E4M3, transpose=backward) if delayed is None else
                        delayed.amaxes.quantize(delayed.x, xp, E4M3, backward))
        wq, ws, wq_t = weight_amax.codes(weight, transpose=backward)
        y = _mm_tensorwise(xq, xs, wq, ws, x.dtype)[:m]
        if bias is not None:
            y = y + bias
        if backward:
            ctx.save_for_backward(xq_t, xs, wq_t, ws)
        ctx.m, ctx.has_bias, ctx.grad_dtype, ctx.group = m, bias is not None, grad_dtype, dgrad_group
        ctx.x_dtype, ctx.w_dtype, ctx.w_needs_grad = x.dtype, weight.dtype, weight.requires_grad
        ctx.fused_weight = weight if fuse_wgrad and backward else None  # the parameter, for its main_grad
        ctx.delayed = delayed
        return y

    @staticmethod
    def backward(ctx, dy):
        xq_t, xs, wq_t, ws = ctx.saved_tensors
        dyp = _pad_rows(dy.contiguous())
        dyq, dys, dyq_t = (quantize_tensor(dyp, ctx.grad_dtype, transpose=ctx.w_needs_grad) if ctx.delayed is None
                           else ctx.delayed.amaxes.quantize(ctx.delayed.dy, dyp, ctx.grad_dtype, ctx.w_needs_grad))
        # dx = dy @ W: W (N, K) column-major is W.T's codes (K, N) transposed back
        dx = _mm_tensorwise(dyq, dys, wq_t, ws, ctx.x_dtype)[:ctx.m]
        if ctx.group is not None:
            dist.all_reduce(dx, group=ctx.group)
        # dW = dy.T @ x: dy.T's codes (N, M), x (M, K) column-major is x.T's codes (K, M) transposed back;
        # e5m2 x e5m2 has no FP8 GEMM, x stays e4m3
        dw = None
        if ctx.w_needs_grad:
            dw = (_accumulated(ctx.fused_weight, (dyq_t, dys, xq_t, xs), ctx.x_dtype) if ctx.fused_weight is not None
                  else _mm_tensorwise(dyq_t, dys, xq_t, xs, ctx.w_dtype))
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None, None, None, None


def fp8_linear_train_tensorwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                grad_dtype: torch.dtype = E4M3, dgrad_group=None,
                                weight_amax: WeightAmax | None = None, fuse_wgrad: bool = False,
                                delayed: DelayedSites | None = None) -> torch.Tensor:
    """x (..., K) @ weight.T (+ bias) with FP8 GEMMs under per-tensor scales, forward and backward; (..., N).
    Pass the layer's own `weight_amax` to keep W's amax between calls (a fresh one recomputes it every call).
    fuse_wgrad: the weight gradient is accumulated into `weight.main_grad` (`_accumulated`). delayed: the layer's
    sites of an `ActivationAmaxes` (x's and dy's scales from earlier steps), None for current scaling."""
    lead = x.shape[:-1]
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    y = Fp8TensorwiseLinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, grad_dtype, dgrad_group,
                                          weight_amax or WeightAmax(), backward, fuse_wgrad, delayed)
    return y.reshape(*lead, weight.shape[0])
