"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt position's logprob of the next prompt token,
its rank and the top k, read from a step's logits of every position (``Scheduled.all_logits``).
"""

from __future__ import annotations

import torch

from lorakit.engine.outputs import TokenLogprob
from lorakit.engine.scheduler import Request, Scheduled, StepPlan

__all__ = ["score_prompts"]


def score_prompts(plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
    """A step with items that keep every position's logits (prompts that asked for their logprobs): each such
    position's ``TokenLogprob`` written into its request's state (by position: a step that runs again writes the
    same); returns the rows that sample. Synchronous (such requests run synchronous steps)."""
    sample_rows, row = [], 0
    for item in plan.items:
        n = len(item.tokens) if item.all_logits else int(item.sample)
        if item.all_logits:
            _score(item, logits, row)
        if item.sample:
            sample_rows.append(row + n - 1)
        row += n
    return logits.index_select(0, torch.tensor(sample_rows, dtype=torch.long, device=logits.device))


def _score(item: Scheduled, logits: torch.Tensor, first: int) -> None:
    """The logprobs of the prompt tokens that follow ``item``'s positions (its logits from row ``first``)."""
    request: Request = item.request
    prompt = request.prompt_ids
    positions = [p for p in range(item.start, item.start + len(item.tokens)) if p + 1 < len(prompt)]
    if not positions:
        return
    rows = torch.arange(first + positions[0] - item.start, first + positions[-1] - item.start + 1,
                        device=logits.device)
    lp = logits.index_select(0, rows).float().log_softmax(dim=-1)
    targets = torch.tensor([prompt[p + 1] for p in positions], device=logits.device)
    chosen = lp.gather(-1, targets[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    k = min(request.params.prompt_logprobs, lp.shape[-1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen, ranks, top_lp, top_ids = (t.tolist() for t in (chosen[:, 0], ranks, top_lp, top_ids))
    for j, p in enumerate(positions):
        request.state.prompt_logprobs[p + 1] = TokenLogprob(prompt[p + 1], chosen[j], dict(zip(top_ids[j], top_lp[j])),
                                                            ranks[j])
