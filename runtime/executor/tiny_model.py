"""`tokenlane make-tiny-model DIR`: a small random-weight checkpoint with a real tokenizer.

The weights are written by transformers' own `LlamaForCausalLM` / `Qwen2ForCausalLM`
(`save_pretrained`, safetensors), so the checkpoint is exactly what any Hugging Face tool
reads, and the correctness tests can compare our runtime with transformers on it. The
tokenizer is a byte-level BPE trained offline with the `tokenizers` library on text that
ships with Python (the standard library's documentation topics and a few module sources),
so no model hub is needed or assumed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import sysconfig
from pathlib import Path
from typing import Optional

ARCHS = ("llama", "qwen2")

# Special tokens, in id order: ids 0..3 are reserved for them.
PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]

# ChatML-style template; every turn ends with the EOS token so a chat reply stops on EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '</s>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text: files of the running Python's standard library (English docs + code).
_CORPUS_FILES = (
    ("pydoc_data/topics.py", 400_000),
    ("textwrap.py", None),
    ("string.py", None),
    ("json/decoder.py", None),
    ("json/encoder.py", None),
    ("difflib.py", None),
    ("argparse.py", None),
)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name, limit in _CORPUS_FILES:
        path = stdlib / name
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text[:limit] if limit else text)
    if not texts:  # a Python without its sources: fall back to docstrings of loaded modules
        texts = [m.__doc__ for m in list(sys.modules.values()) if getattr(m, "__doc__", None)]
    # Lines as training "documents": the BPE trainer counts words per document.
    return [line for text in texts for line in text.splitlines() if line.strip()]


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE once per vocab size and process; return its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Llama-style: a BOS token in front of every encoded text.
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok.to_str()


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> int:
    """Train (or reuse) the tokenizer and save it the Hugging Face way; return its vocab size."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    # Portable across transformers 4.x/5.x loaders: the generic fast class, and the chat
    # template inline as well as in chat_template.jinja (where 5.x writes it).
    config_path = Path(out_dir) / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config["add_bos_token"] = True
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    return backend.get_vocab_size()


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: Optional[bool] = None,
    rope_scaling: Optional[dict] = None,
    rope_theta: float = 10000.0,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a
    chat template) and generation_config.json into `out_dir`; return it as a Path.

    `tie_word_embeddings` defaults to False for llama and True for qwen2 (as the small Qwen2
    checkpoints ship). `initializer_range` is larger than transformers' 0.02 so that random
    logits are well separated and greedy decoding is not decided by rounding noise.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    real_vocab = write_tokenizer(out, vocab_size, max_position_embeddings)
    # The embedding table covers the requested size even if BPE learned fewer merges.
    vocab_size = max(vocab_size, real_vocab)

    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters = {**rope_parameters, **rope_scaling}
        rope_parameters.setdefault("rope_type", rope_scaling.get("type", "default"))
        rope_parameters.pop("type", None)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        initializer_range=initializer_range,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        tie_word_embeddings=(arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
        model_cls = LlamaForCausalLM
    else:
        config = Qwen2Config(**common, use_sliding_window=False)
        model_cls = Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    from transformers.utils import logging as hf_logging

    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in CLI/test output
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenlane make-tiny-model",
        description="Write a small random-weight Llama-family checkpoint with a real tokenizer.",
    )
    parser.add_argument("dir", help="output folder (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tie-word-embeddings", dest="tie", action="store_true", default=None)
    tie.add_argument("--untie-word-embeddings", dest="tie", action="store_false")
    parser.add_argument(
        "--rope-scaling",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(
            args.dir,
            arch=args.arch,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=args.tie,
            rope_scaling=args.rope_scaling,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"tokenlane make-tiny-model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
