"""DeepSeekMoE routing in Triton: one program per token does what `reference.moe_route` does in a dozen
launches (scores, bias, group scores, group top-k, masked top-k, gather, normalise, scale).

The token's E logits are held as a [groups, group size] tile. Top-k is k rounds of "take the maximum,
then mask it"; a tie goes to the lower expert id (torch.topk leaves ties unspecified)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2

_SCORING = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}


@triton.jit
def _route(
    Logits, Bias, Weights, Ids, stride_l, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, G_PAD)
    member = tl.arange(0, GS_PAD)
    expert = groups[:, None] * GROUP_SIZE + member[None, :]
    valid = (groups[:, None] < NUM_GROUPS) & (member[None, :] < GROUP_SIZE)
    x = tl.load(Logits + t * stride_l + expert, mask=valid, other=float("-inf"))
    if SCORING == 0:
        s = tl.sigmoid(x)
    elif SCORING == 1:
        e = tl.exp(x - tl.max(tl.max(x, 1), 0))
        e = tl.where(valid, e, 0.0)
        s = e / tl.sum(tl.sum(e, 1), 0)
    else:  # sqrt(softplus), with F.softplus's linear branch past 20
        s = tl.sqrt(tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))
    s = tl.where(valid, s, 0.0)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(Bias + expert, mask=valid, other=0.0)
    # NaN scores (diverged dummy weights) rank lowest, and every id stays < E: a bad id would fault later
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    if NUM_GROUPS > 1:
        top1 = tl.max(choice, 1)
        if HAS_BIAS:  # the sum of each group's two best
            first = tl.min(tl.where(choice == top1[:, None], member[None, :], GS_PAD), 1)
            rest = tl.where(member[None, :] == first[:, None], float("-inf"), choice)
            group_score = top1 + tl.max(rest, 1)
        else:
            group_score = top1
        group_score = tl.where(groups < NUM_GROUPS, group_score, float("-inf"))
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == best, groups, G_PAD), 0)
            keep = keep | (groups == pick)
            group_score = tl.where(groups == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int64)
    w = tl.zeros([K_PAD], tl.float32)
    big = G_PAD * GROUP_SIZE + GS_PAD
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, 1), 0)
        pick = tl.minimum(
            tl.min(tl.min(tl.where(choice == best, expert, big), 1), 0), NUM_GROUPS * GROUP_SIZE - 1
        )
        hit = expert == pick
        ids = tl.where(slots == i, pick.to(tl.int64), ids)
        w = tl.where(slots == i, tl.sum(tl.sum(tl.where(hit, s, 0.0), 1), 0), w)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALIZE:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(Weights + t * TOP_K + slots, w * scaling, mask=slots < TOP_K)
    tl.store(Ids + t * TOP_K + slots, ids, mask=slots < TOP_K)


def moe_route(
    logits, bias, top_k, num_groups=1, topk_group=1, scoring="sigmoid", normalize=True, scaling=1.0
):
    """`MoeRoute`."""
    num_tokens, num_experts = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and num_experts % num_groups == 0
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // num_groups
    _route[(num_tokens,)](
        logits, logits if bias is None else bias, weights, ids, logits.stride(0), float(scaling),
        TOP_K=top_k, K_PAD=next_pow2(top_k), NUM_GROUPS=num_groups, TOPK_GROUP=topk_group,
        GROUP_SIZE=group_size, G_PAD=next_pow2(num_groups), GS_PAD=next_pow2(group_size),
        SCORING=_SCORING[scoring], HAS_BIAS=bias is not None, NORMALIZE=normalize and top_k > 1,
        num_warps=1 if num_experts <= 64 else 2,
    )  # fmt: skip
    return weights, ids
