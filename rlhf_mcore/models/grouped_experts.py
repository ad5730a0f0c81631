"""The train engine's MoE experts: every local expert's SwiGLU MLP in one grouped GEMM per projection.

`GroupedExperts` replaces megatron-core's `SequentialMLP` (one `MLP` per local expert, a Python loop of 2 x E small
GEMMs per layer) in the MoE layers' spec (`moe.moe_block_spec`), with the same interface: built as
`GroupedExperts(num_local_experts, config, pg_collection=)`, called as
`forward(permuted_local_hidden_states (T, H), tokens_per_expert (E_local,), permuted_probs (T,))` on tokens grouped by
local expert (the dispatcher's order), returning `(output (T, H), None)`.

Weights, stacked over this EP rank's experts `ep_rank * E_local ..` (`moe.expert_offset`):
- `fc1_weight` (E_local, 2 F / TP, H): per expert what `SequentialMLP`'s `linear_fc1.weight` holds on this TP rank,
  [gate_r; up_r] (column parallel);
- `fc2_weight` (E_local, H, F / TP): its `linear_fc2.weight` (row parallel).
F = `moe_ffn_hidden_size`. Expert TP = TP and no communication here, as in Megatron's experts (`explicit_expert_comm`):
the alltoall dispatcher gathers and reduces over TP. The parameters carry Megatron's attributes
(`tensor_model_parallel`, `allreduce=False` under EP: their gradients reduce over the expert-data-parallel group).

Numerics, as `SequentialMLP` -> `MLP.forward(tokens, per_token_scale=probs)` without activation fusion (the config
here: `bias_activation_fusion=False`): `fc2(swiglu(fc1(x)) * probs)`, the probs multiplied after the activation in
fp32 and cast back to the activations' dtype; with `moe_apply_probs_on_input` (top-1 only) they scale the input
instead and the activation's scale is 1, exactly as there.

The GEMMs: `kernels.grouped_mm` (`torch._grouped_mm` on CUDA in bf16, a loop over experts elsewhere).

Checkpoints: `sharded_state_dict` writes `SequentialMLP`'s keys and global shapes (`{prefix}experts.linear_fc1.weight`
(E, 2F, H) with [gate; up] along axis 1, `{prefix}experts.linear_fc2.weight` (E, H, F); the expert axis sharded over
EP),
so checkpoints of either experts module load into the other. The HF loader and exporter see one view per local
expert under `SequentialMLP`'s parameter names (`per_expert_views`), so the weight map is unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule

from rlhf_mcore.kernels.grouped_mm import grouped_mm

# stacked parameter -> (SequentialMLP's name of one expert's slice, TP-split axis of the stacked tensor)
STACKED = {"fc1_weight": ("linear_fc1.weight", 1), "fc2_weight": ("linear_fc2.weight", 2)}


class GroupedExperts(MegatronModule):
    """A MoE layer's local experts as stacked weights and grouped GEMMs (module docstring)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("GroupedExperts has no expert biases (add_bias_linear=False in the MoE models here).")
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("GroupedExperts computes SwiGLU experts (gated_linear_unit with silu).")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        tp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size // tp
        if ffn * tp != config.moe_ffn_hidden_size:
            raise ValueError(f"TP size {tp} must divide moe_ffn_hidden_size={config.moe_ffn_hidden_size}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        e, h, dtype = num_local_experts, config.hidden_size, config.params_dtype
        self.fc1_weight = torch.nn.Parameter(torch.empty(e, 2 * ffn, h, device=device, dtype=dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(e, h, ffn, device=device, dtype=dtype))
        expert_parallel = config.expert_model_parallel_size > 1
        for name, (_, axis) in STACKED.items():
            param = getattr(self, name)
            set_tensor_model_parallel_attributes(param, True, axis, 1)
            param.allreduce = not expert_parallel  # Megatron's mark of an expert-parallel parameter
        if config.perform_initialization:
            self._initialize(config)

    def _initialize(self, config) -> None:
        """Megatron's init methods (fc2: the output-layer one), on the expert-parallel RNG stream on a GPU."""
        import contextlib

        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        rng = (get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()) if self.fc1_weight.is_cuda
               else contextlib.nullcontext())
        with torch.no_grad(), rng:
            config.init_method(self.fc1_weight)
            config.output_layer_init_method(self.fc2_weight)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # SequentialMLP's: scale the input, then probs of 1
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1.")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = torch.as_tensor(tokens_per_expert)
        fc1 = grouped_mm(x, self.fc1_weight, counts)  # (T, 2 F / TP): [gate; up] of each token's expert
        gate, up = torch.chunk(fc1, 2, dim=-1)
        act = F.silu(gate) * up
        act = (act * probs.unsqueeze(-1)).to(act.dtype)
        return grouped_mm(act, self.fc2_weight, counts), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """`SequentialMLP`'s checkpoint layout (module docstring): fc1 as a factory of its gate and up halves."""
        ep, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        pre = len(sharded_offsets)
        replica_id = (0, 0, self.dp_group.rank())
        experts = (pre, ep_rank, ep)  # the stacked axis 0: this EP rank's block of the global experts

        def fc1_parts(key, t, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("GroupedExperts' fc1 checkpoint shards whole tensors (no flattened range)")
            gate, up = torch.chunk(t, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(key, part.contiguous(), *sharded_offsets, experts,
                                                    (pre + 1, offset, 2 * tp), replica_id=replica_id,
                                                    prepend_axis_num=pre)
                    for part, offset in ((gate, tp_rank), (up, tp + tp_rank))]

        def fc1_merge(parts):
            with torch.no_grad():
                return torch.cat(parts, dim=1)

        # SequentialMLP's keys: its experts' "local_experts.{i}." prefix becomes "experts."
        fc1_key, fc2_key = (f"{prefix}experts.{STACKED[n][0]}" for n in ("fc1_weight", "fc2_weight"))
        return {  # keyed by this module's state-dict names (what load_state_dict reads), checkpoint keys inside
            prefix + "fc1_weight": ShardedTensorFactory(fc1_key, self.fc1_weight, fc1_parts, fc1_merge, replica_id),
            prefix + "fc2_weight": ShardedTensor.from_rank_offsets(fc2_key, self.fc2_weight, *sharded_offsets, experts,
                                                     (pre + 2, tp_rank, tp), replica_id=replica_id,
                                                     prepend_axis_num=pre),
        }


def per_expert_views(name: str, param: torch.Tensor):
    """[(name, param)] for any parameter but a `GroupedExperts` stacked one, which gives one (SequentialMLP's name
    `...experts.local_experts.{i}.linear_fc1.weight`, param[i]) per local expert: what the HF weight map reads and
    writes (a view: copying into it fills the stacked parameter)."""
    base, _, leaf = name.rpartition(".")
    if leaf not in STACKED or not base.endswith(".experts"):
        return [(name, param)]
    suffix = STACKED[leaf][0]
    return [(f"{base}.local_experts.{i}.{suffix}", param[i]) for i in range(param.shape[0])]
