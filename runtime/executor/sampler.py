"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and
the logits processors: logit_bias, min_tokens, repetition/frequency/presence penalties.

The sampler only picks token ids. Whether a token finishes its request (EOS, stop token
ids, stop strings, max_tokens, ignore_eos) is decided by the engine's output processing.

Random rows use the exponential-race trick (argmax of p / E with E ~ Exp(1), equivalent to
drawing from p), so one batched argmax serves every row; a row with its own seed draws its
noise from its own `torch.Generator`, so its output depends only on its seed and logits,
not on which other requests share the batch.

Order, as vLLM applies them: logit_bias and min_tokens, then the repetition penalty (prompt
and generated tokens, HF/vLLM semantics), the frequency and presence penalties (generated
tokens, OpenAI semantics), then greedy argmax, or temperature, top-k/top-p and min-p and the
draw. Every processor is batched torch over the rows that use it (no Python loop over the
vocabulary); the raw logits are never modified, so logprobs stay the model's distribution.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tokenlane.kernels import api as kernels
from tokenlane.runtime.core.request import SamplingParams


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p x the top token's.

    logits: [N, V] float (after temperature); min_p: [N] float in [0, 1] (0 = off)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _id_matrix(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, W] long token ids, [N, W] bool valid) of the rows, padded to the longest row
    with the row's own first id (a duplicate, so a gather/scatter through it is harmless)
    and marked invalid there. Rows must be non-empty."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    valid = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    return ids, valid


def apply_logits_processors(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Any]
) -> torch.Tensor:
    """logit_bias, min_tokens and the penalties, applied to a float32 copy of `logits` [N, V].

    histories[i] has `prompt_token_ids`, `output_token_ids` and `eos_token_id` (a Request):
    the tokens the penalties count and min_tokens suppresses. The penalties gather and
    scatter at the rows' own token ids (cost: the tokens they count, not the vocabulary)."""
    n, vocab = logits.shape
    dev = logits.device
    out = logits.to(torch.float32, copy=True)

    # logit_bias: added to the logits (OpenAI); ids past the vocabulary are skipped.
    bias_rows, bias_ids, bias_values = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias.items():
            if 0 <= token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
    if bias_rows:
        out.index_put_(
            (torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
            torch.tensor(bias_values, dtype=torch.float32, device=dev),
            accumulate=True,
        )

    # min_tokens: EOS and the stop token ids cannot be drawn before that many tokens.
    ban_rows, ban_ids = [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        if p.min_tokens and len(h.output_token_ids) < p.min_tokens:
            ids = set(p.stop_token_ids)
            if h.eos_token_id is not None:
                ids.add(h.eos_token_id)
            for token in ids:
                if 0 <= token < vocab:
                    ban_rows.append(i)
                    ban_ids.append(token)
    if ban_rows:
        out[torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)] = float("-inf")

    # repetition_penalty (HF/vLLM): tokens seen in the prompt or output: positive logits
    # divided by it, negative ones multiplied (once per token, however often it was seen).
    rep = [i for i, p in enumerate(params)
           if p.repetition_penalty != 1.0 and (histories[i].prompt_token_ids or histories[i].output_token_ids)]
    if rep:
        ids, _ = _id_matrix([histories[i].prompt_token_ids + histories[i].output_token_ids for i in rep], dev)
        ids = ids.clamp(0, vocab - 1)
        rows = torch.tensor(rep, device=dev).unsqueeze(1).expand_as(ids)
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32, device=dev)
        penalty = penalty.unsqueeze(1)
        values = out[rows, ids]  # duplicates read the same value and write the same result
        out[rows, ids] = torch.where(values > 0, values / penalty, values * penalty)

    # frequency and presence penalties (OpenAI): logit - count * frequency - (count > 0) * presence,
    # counting the generated tokens only.
    freq = [i for i, p in enumerate(params)
            if (p.frequency_penalty or p.presence_penalty) and histories[i].output_token_ids]
    if freq:
        ids, valid = _id_matrix([histories[i].output_token_ids for i in freq], dev)
        ids = ids.clamp(0, vocab - 1)
        fp = torch.tensor([params[i].frequency_penalty for i in freq], dtype=torch.float32, device=dev)
        pp = torch.tensor([params[i].presence_penalty for i in freq], dtype=torch.float32, device=dev)
        # Presence: once per distinct token, at the first slot of its run in the sorted row
        # (padding repeats a real id of the row, so it adds no distinct token).
        ids_sorted, order = ids.sort(dim=1)
        first = torch.ones_like(valid)
        first[:, 1:] = ids_sorted[:, 1:] != ids_sorted[:, :-1]
        delta = -(valid.gather(1, order).float() * fp.unsqueeze(1)) - first.float() * pp.unsqueeze(1)
        rows = torch.tensor(freq, device=dev).unsqueeze(1).expand_as(ids_sorted)
        out.index_put_((rows, ids_sorted), delta, accumulate=True)
    return out


# Below this a temperature is greedy: dividing logits by it overflows float32 to inf, and the
# softmax of inf is NaN (vLLM treats temperatures under 1e-5 the same way).
MIN_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """Whether a row takes the argmax (temperature 0, top_k 1, or a temperature too small to
    divide by)."""
    return params.greedy or params.temperature < MIN_TEMPERATURE


def argmax_only(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its raw logits and nothing else reads them:
    greedy, no logits processors, no logprobs, no grammar. A batch of such rows may take its
    tokens from the LM head without logits (PrepackedLinear.argmax)."""
    return (is_greedy(params) and not params.uses_logits_processors and params.logprobs is None
            and params.grammar is None)


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
        histories: Optional[Sequence[Any]] = None,
    ) -> list[int]:
        """`histories` (the requests, one per row) are needed when a row uses a penalty or
        min_tokens; `logits` is left unchanged (logprobs are computed from it)."""
        assert logits.shape[0] == len(params) == len(generators)
        if any(p.uses_logits_processors for p in params):
            if histories is None:
                raise ValueError("penalties and min_tokens need the requests' token histories")
            logits = apply_logits_processors(logits, params, histories)
        greedy = [is_greedy(p) for p in params]
        tokens = kernels.argmax_rows(logits)
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
        min_p = [params[i].min_p for i in rows]
        if any(m > 0.0 for m in min_p):
            sub = apply_min_p(sub, torch.tensor(min_p, dtype=sub.dtype, device=logits.device))
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
