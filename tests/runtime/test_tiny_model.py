"""`tokenlane make-tiny-model`: a loadable checkpoint with a real tokenizer, from nothing."""

from __future__ import annotations

import json

import pytest
import torch

from tokenlane.runtime.executor.tiny_model import main, make_tiny_model


def test_llama_checkpoint_files_and_config(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_model_dir / name).is_file(), name
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"]) == (64, 2, 4, 2)
    assert cfg["tie_word_embeddings"] is False
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "<s>" and tok_cfg["eos_token"] == "</s>"
    assert "chat_template" in tok_cfg


def test_qwen2_is_tied_with_qkv_bias(tiny_qwen2_dir):
    from safetensors import safe_open

    cfg = json.loads((tiny_qwen2_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True
    with safe_open(str(tiny_qwen2_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "lm_head.weight" not in names  # tied to the embeddings


def test_transformers_loads_it_and_tokenizer_round_trips(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "def greet(name):\n    return f'Hello, {name}!'  # naïve café ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    # A trained BPE, not bytes: common words are single tokens.
    assert len(ids) < 0.7 * len(text.encode())
    assert len(tok.encode("the return value of the function", add_special_tokens=False)) <= 8
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhi</s>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    from safetensors.torch import load_file

    a = load_file(str(make_tiny_model(tmp_path / "a", num_layers=1, seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", num_layers=1, seed=3) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", num_layers=1, seed=4) / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])


def test_cli_sizes_and_arch(tmp_path, capsys):
    out = tmp_path / "q"
    assert main([str(out), "--arch", "qwen2", "--hidden-size", "32", "--num-heads", "2",
                 "--num-kv-heads", "1", "--num-layers", "1", "--vocab-size", "600"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        "qwen2", 32, 1, 600)
    assert "wrote qwen2 checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--hidden-size", "30", "--num-heads", "4"], "multiple of num_heads"),
    (["--num-heads", "4", "--num-kv-heads", "3"], "multiple of num_kv_heads"),
    (["--vocab-size", "100"], "vocab_size"),
])
def test_cli_rejects_bad_sizes(tmp_path, capsys, argv, message):
    assert main([str(tmp_path / "m"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_console_script_dispatch(tmp_path):
    from tokenlane.cli import main as cli_main

    assert cli_main(["make-tiny-model", str(tmp_path / "m"), "--num-layers", "1"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
