"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

The sampler only picks token ids. Whether a token finishes its request (EOS, stop token
ids, stop strings, max_tokens, ignore_eos) is decided by the engine's output processing.

Random rows use the exponential-race trick (argmax of p / E with E ~ Exp(1), equivalent to
drawing from p), so one batched argmax serves every row; a row with its own seed draws its
noise from its own `torch.Generator`, so its output depends only on its seed and logits,
not on which other requests share the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tokenlane.runtime.request import SamplingParams


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and nucleus top-p set.

    logits: [N, V] float; top_k: [N] int (0 or >= V = off); top_p: [N] float (1 = off).
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
        kth = sorted_logits.gather(1, (k - 1).long().unsqueeze(1))  # the k-th largest value
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one
        # always stays).
        cum_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(cum_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


# Below this a temperature is greedy: dividing logits by it overflows float32 to inf, and the
# softmax of inf is NaN (vLLM treats temperatures under 1e-5 the same way).
MIN_TEMPERATURE = 1e-5


class Sampler:
    """Samples one token per row of a [N, V] logits batch."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        # For rows without a seed: reproducible per engine (engine.seed), shared.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> list[int]:
        assert logits.shape[0] == len(params) == len(generators)
        greedy = [p.greedy or p.temperature < MIN_TEMPERATURE for p in params]
        tokens = logits.argmax(dim=-1)
        if all(greedy):
            return tokens.tolist()

        rows = [i for i, g in enumerate(greedy) if not g]
        rows_t = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, rows_t).float()
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        top_k = [params[i].top_k for i in rows]
        top_p = [params[i].top_p for i in rows]
        need_k = any(k > 0 for k in top_k)
        need_p = any(p < 1.0 for p in top_p)
        if need_k or need_p:
            sub = apply_top_k_top_p(
                sub,
                torch.tensor(top_k, device=logits.device) if need_k else None,
                torch.tensor(top_p, device=logits.device) if need_p else None,
            )
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, i in enumerate(rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        picked = (probs / noise).argmax(dim=-1)
        tokens[rows_t] = picked
        return tokens.tolist()


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g
