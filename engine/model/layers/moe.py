"""Mixture of experts (DeepSeek-V2/V3, Qwen2/Qwen3-MoE): a replicated router, routed experts
split over the expert-parallel group, shared experts as a tensor-parallel dense MLP (Qwen2-MoE:
one shared expert gated per token by a sigmoid)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TPGroup, all_reduce_sum, get_ep_group, get_tp_group
from engine.model import kernels
from engine.model.config import MoEConfig, QwenMoeConfig
from engine.model.layers.linear import ReplicatedLinear, divide, new_parameter
from engine.model.layers.mlp import SwiGLUMLP, swiglu

DENSE_MAX_TOKENS = 64  # up to this many tokens, every local expert runs on every token (no host sync)
# checkpoint name of an expert's projection -> (RoutedExperts parameter, part): a model's ``expert_params``
EXPERT_PARAMS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


def expert_group(tp: TPGroup) -> TPGroup:
    """The expert-parallel group of a model built over ``tp``: the engine's EP group when ``tp``
    is the engine's TP group, else ``tp``'s ranks under the name "ep" (a rank built in one process)."""
    return get_ep_group() if tp == get_tp_group() else dataclasses.replace(tp, name="ep")


class TopKRouter(nn.Module):
    """``x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)``, replicated on every rank.

    Scores are softmax (V2, Qwen) or sigmoid (V3) of ``x W^T`` in float32. Experts are chosen from
    ``scores + e_score_correction_bias`` (the bias exists for ``noaux_tc`` only): ``greedy``
    takes the top k of all; ``group_limited_greedy`` / ``noaux_tc`` first keep the
    ``topk_group`` best of ``n_group`` expert groups, a group scored by its best expert
    (``group_limited_greedy``) or its two best summed (``noaux_tc``). The weights are the
    chosen experts' scores (without the bias), renormalised to sum to 1 when
    ``norm_topk_prob``, then times ``routed_scaling_factor``.
    """

    def __init__(self, hidden_size: int, ds: MoEConfig):
        super().__init__()
        self.ds = ds
        self.decode_gemv_rows = kernels.decode_gemv_rows(torch.get_default_device())
        self.weight = nn.Parameter(torch.empty(ds.n_routed_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(ds.n_routed_experts, dtype=torch.float32), requires_grad=False)
            if ds.topk_method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ds = self.ds
        if self.decode_gemv_rows and x.dim() == 2 and x.shape[0] <= self.decode_gemv_rows:
            # float32 logits from the bf16 rows in one launch, no cast kernel
            logits = kernels.decode_gemv(x, self.weight)
        else:
            logits = F.linear(x.float(), self.weight)  # float32, as transformers computes them
        scores = logits.softmax(dim=-1) if ds.scoring_func == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if ds.topk_method != "greedy" and ds.n_group > 1:
            grouped = choice.view(x.shape[0], ds.n_group, -1)
            group_scores = (grouped.topk(2, dim=-1).values.sum(-1) if ds.topk_method == "noaux_tc"
                            else grouped.amax(dim=-1))
            best_groups = group_scores.topk(ds.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        if choice is scores:  # plain top-k: its values are the weights
            weights, ids = scores.topk(ds.num_experts_per_tok, dim=-1)
        else:
            ids = choice.topk(ds.num_experts_per_tok, dim=-1).indices
            weights = scores.gather(1, ids)
        if ds.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights if ds.routed_scaling_factor == 1.0 else weights * ds.routed_scaling_factor), ids


class RoutedExperts(nn.Module):
    """This rank's routed experts: ``(x [T, H], weights [T, k], ids [T, k]) -> [T, H]``, the
    weighted sum of the outputs of the chosen experts this rank owns (other ranks' experts
    contribute zero here; the caller sums over the EP group).

    Rank r of the EP group owns experts ``[r * E / ep, (r + 1) * E / ep)`` and holds only
    their weights: ``gate_up_proj [E_local, 2 * I, H]`` (gate | up), ``down_proj [E_local, H, I]``.
    They load per expert from checkpoint tensors ``experts.<e>.{gate,up,down}_proj.weight``
    with shard id ``(e, 0 | 1)``; ``owns_shard`` tells the loader which are this rank's.

    Tokens meet experts in one of three ways, by step size (shapes only, never values):
    few assignments (``T * k <= E_local``, e.g. small decode batches): each token's row meets
    each of its experts' weights where they lie (``kernels.expert_gemv``, no copy of weights or
    rows); up to ``DENSE_MAX_TOKENS`` tokens: every local expert runs on every token and the
    routing weights (zero for experts not chosen) combine them — neither reads a value on the
    host; more tokens (prefill): assignments are sorted by expert and two grouped GEMMs run
    every local expert on its own rows. Only under EP (``E_local < E``) are the ids mapped to
    local ones and other ranks' experts marked (zero weight); with one rank nothing is.
    Quantized experts (``quant_method`` set by a quantization scheme) take one path at every size.
    """

    quant_method = None  # a quantization scheme's experts method: apply(layer, x, weights, local ids)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, ep: TPGroup):
        super().__init__()
        if hidden_size % 8 or intermediate_size % 8:
            raise ValueError(f"hidden_size ({hidden_size}) and moe_intermediate_size ({intermediate_size}) must be "
                             "multiples of 8: the grouped expert GEMMs need 16-byte rows")
        self.num_experts = num_experts
        self.num_local = divide(num_experts, ep.size, "n_routed_experts")
        self.expert_start = ep.rank * self.num_local
        self.intermediate_size = intermediate_size
        self.gate_up_proj = new_parameter(self.num_local, 2 * intermediate_size, hidden_size,
                                          weight_loader=self.weight_loader)
        self.down_proj = new_parameter(self.num_local, hidden_size, intermediate_size,
                                       weight_loader=self.weight_loader)
        local_ids = range(self.expert_start, self.expert_start + self.num_local)
        self.gate_up_proj.expected_shards = {(e, part) for e in local_ids for part in (0, 1)}
        self.down_proj.expected_shards = {(e, 0) for e in local_ids}
        for param in (self.gate_up_proj, self.down_proj):
            param.owns_shard = self.owns_shard

    def owns_shard(self, shard_id: tuple[int, int]) -> bool:
        """Whether expert ``shard_id[0]`` is this rank's; an expert id the model does not have
        is a ValueError (never silently another rank's)."""
        if not 0 <= shard_id[0] < self.num_experts:
            raise ValueError(f"expert {shard_id[0]} does not exist (n_routed_experts = {self.num_experts})")
        return self.expert_start <= shard_id[0] < self.expert_start + self.num_local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int],
                      presliced: bool = False) -> None:
        """Load one expert's ``gate_proj`` (part 0) / ``up_proj`` (part 1) / ``down_proj`` weight."""
        expert, part = shard_id
        if not self.owns_shard(shard_id):
            raise ValueError(f"expert {expert} is not on this rank (it holds experts "
                             f"{self.expert_start}..{self.expert_start + self.num_local - 1})")
        dst = param.data[expert - self.expert_start]
        if getattr(param, "scale_of", param) is self.gate_up_proj:  # the weight, or its block scales
            rows = getattr(param, "block_rows", 1)
            dst = dst.narrow(0, part * self.intermediate_size // rows, -(-self.intermediate_size // rows))
        if tuple(loaded.shape) != tuple(dst.shape):
            raise ValueError(f"expert weight of shape {tuple(loaded.shape)} does not match {tuple(dst.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """``add [T, H]`` (e.g. the shared experts' output) is summed in the combining batched GEMM."""
        weights = weights.to(x.dtype)
        if self.quant_method is not None:  # quantized experts: one path at every size (id -1: another rank's)
            path, foreign_id = self._quantized, -1
        elif ids.numel() <= self.num_local:
            path, foreign_id = self._gathered, -1
        elif x.shape[0] <= DENSE_MAX_TOKENS:
            path, foreign_id = self._dense, 0  # its routing weight is zero: expert 0 adds nothing
        else:
            path, foreign_id = self._grouped, self.num_local
        if self.num_local < self.num_experts:  # expert parallel: map to local ids, mark other ranks' experts
            ids = ids - self.expert_start
            foreign = (ids < 0) | (ids >= self.num_local)
            weights = weights.masked_fill(foreign, 0)
            ids = ids.masked_fill(foreign, foreign_id)
        return path(x, weights, ids, add)

    @staticmethod
    def _combine(weights: torch.Tensor, rows: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        """``add + sum_j weights[t, j] * rows[t, j]``: ``weights [T, J]``, ``rows [T, J, H]`` -> ``[T, H]``,
        one batched GEMM (``add`` None: nothing added)."""
        if add is None:
            return torch.bmm(weights.unsqueeze(1), rows).squeeze(1)
        return torch.baddbmm(add.unsqueeze(1), weights.unsqueeze(1), rows).squeeze(1)

    def _quantized(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   add: torch.Tensor | None) -> torch.Tensor:
        y = self.quant_method.apply(self, x, weights, ids)
        return y if add is None else y + add

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  add: torch.Tensor | None) -> torch.Tensor:
        """Each token's row times each of its experts' weights, read in place (``expert_gemv``;
        id -1, another rank's expert: a zero row, no weights read), summed with its weights."""
        tokens, per_token = ids.shape
        act = swiglu(kernels.expert_gemv(x, self.gate_up_proj, ids))                       # [T, k, I]
        y = kernels.expert_gemv(act.view(tokens * per_token, -1), self.down_proj, ids.view(-1, 1))  # [T*k, 1, H]
        return self._combine(weights, y.view(tokens, per_token, -1), add)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               add: torch.Tensor | None) -> torch.Tensor:
        """Every local expert on every token, combined by the routing weights scattered to
        ``[T, E_local]`` (zero for the experts a token did not choose)."""
        dense_weights = torch.zeros(x.shape[0], self.num_local, dtype=x.dtype, device=x.device)
        dense_weights.scatter_add_(1, ids, weights)
        act = swiglu(torch.matmul(x, self.gate_up_proj.transpose(1, 2)))   # [E_local, T, I]
        y = torch.bmm(act, self.down_proj.transpose(1, 2))                     # [E_local, T, H]
        return self._combine(dense_weights, y.transpose(0, 1), add)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 add: torch.Tensor | None) -> torch.Tensor:
        """Assignments sorted by expert (``experts == E_local`` marks another rank's, sorted last),
        two grouped GEMMs over the local experts (``torch._grouped_mm``, group ends found on the
        device: one CUTLASS launch each for bf16 on sm90, no host read; elsewhere torch loops over
        the groups after reading the ends), then the rows go back to token order and a batched
        matmul sums each token's rows with its routing weights (no atomics)."""
        flat = experts.flatten()                                                          # [N]
        order = flat.argsort(stable=True)
        first_ids = torch.arange(1, self.num_local + 1, device=x.device)
        ends = torch.searchsorted(flat[order], first_ids, out_int32=True)               # [E_local]
        rows = x[order // experts.shape[1]]                                               # [N, H]
        act = swiglu(torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends))
        y = torch._grouped_mm(act, self.down_proj.transpose(1, 2), offs=ends)            # [N, H]
        position = torch.arange(flat.shape[0], device=x.device)
        y.masked_fill_(position[:, None] >= ends[-1], 0)    # rows past the last group are undefined
        token_order = torch.empty_like(order).index_put_((order,), position)
        y = y[token_order].view(*experts.shape, -1)                                       # [T, k, H]
        return self._combine(weights, y, add)


class MoE(nn.Module):
    """``[T, H] -> [T, H]``: routed experts (expert-parallel, one all-reduce over the EP group)
    plus ``n_shared_experts`` shared experts run as one TP dense MLP on every token."""

    def __init__(self, hidden_size: int, ds: MoEConfig, tp: TPGroup, ep: TPGroup):
        super().__init__()
        self.ep = ep
        self.gate = TopKRouter(hidden_size, ds)
        self.experts = RoutedExperts(hidden_size, ds.moe_intermediate_size, ds.n_routed_experts, ep)
        self.shared_experts = (SwiGLUMLP(hidden_size, ds.moe_intermediate_size * ds.n_shared_experts, tp)
                               if ds.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.ep.size == 1 and self.shared_experts is not None:  # one GEMM combines the experts and adds
            return self.experts(x, weights, ids, add=self.shared_experts(x))
        out = self.experts(x, weights, ids)
        if self.ep.size > 1:
            out = all_reduce_sum(out, self.ep.name)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class GatedSharedExpertMoE(MoE):
    """Qwen2-MoE's block, ``[T, H] -> [T, H]``: ``MoE``'s routed experts plus one shared expert
    (a TP SwiGLU MLP of ``shared_expert_intermediate_size``) whose output each token scales by
    ``sigmoid(shared_expert_gate(x))``, a replicated ``H -> 1`` projection."""

    def __init__(self, hidden_size: int, cfg: QwenMoeConfig, tp: TPGroup, ep: TPGroup):
        super().__init__(hidden_size, cfg, tp, ep)
        self.shared_expert = SwiGLUMLP(hidden_size, cfg.shared_expert_intermediate_size, tp)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
