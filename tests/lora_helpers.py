"""PEFT LoRA adapters for tests, made with `peft` on the tiny checkpoints, and their references.

`make_peft_adapter` writes a PEFT folder (adapter_config.json + adapter_model.safetensors) as a
user's fine-tune would be saved, with lora_B non-zero (PEFT initialises it to zero, which would
leave the base's outputs unchanged). `peft_reference` is transformers + `peft.PeftModel` over the
same base, the reference the runtime's outputs must equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir, out_dir, *, r: int, seed: int, lora_alpha: Optional[float] = None,
                      target_modules: Sequence[str] = ALL_TARGETS, use_rslora: bool = False,
                      b_std: float = 0.05) -> Path:
    """A LoRA adapter of rank `r` for the checkpoint in `base_dir`, saved into `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
                        target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


_REFERENCES: dict = {}


def peft_reference(base_dir, adapter_dir=None):
    """transformers' model of `base_dir` (float32, eval), wrapped in `PeftModel` with the adapter
    when one is given; cached per (base, adapter)."""
    key = (str(base_dir), str(adapter_dir))
    if key not in _REFERENCES:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # full lengths, EOS ignored
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        _REFERENCES[key] = model
    return _REFERENCES[key]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of `prompt` and each token's logprob (log_softmax of the float32 logits)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(score[0].float(), dim=-1)[t].item() for score, t in zip(out.scores, tokens)]
    return tokens, logprobs

