"""lm-eval's `local-completions` runs a multiple-choice task to the end against the real
server with `--batch_size 4` (lists of 4 token-id prompts, echo + logprobs + max_tokens 1),
and the log-likelihoods it records equal transformers' on the same checkpoint.

Opt-in (`-m slow`) and skipped without lm-eval: it is not a test dependency. Install it in
a separate environment and point at its command, e.g.

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install 'lm-eval[api]==0.4.13' transformers
    TOKENLANE_LM_EVAL=/tmp/lmeval/bin/lm_eval .venv/bin/python -m pytest -m slow tests/server/test_lm_eval.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import pytest
import torch

from tokenlane.runtime.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What color is the sky?", ["blue", "green", "red", "loud"], 0),
    ("How many legs does a cat have?", ["four", "two", "nine", "none"], 0),
    ("Which is a fruit?", ["a chair", "an apple", "a road", "a cloud"], 1),
    ("What do bees make?", ["steel", "glass", "honey", "paper"], 2),
    ("Where do fish live?", ["in trees", "in deserts", "on clouds", "in water"], 3),
    ("What is frozen water?", ["ice", "fire", "sand", "smoke"], 0),
]


def _lm_eval_command() -> str:
    command = os.environ.get("TOKENLANE_LM_EVAL") or shutil.which("lm_eval")
    if not command:
        pytest.skip("lm-eval is not installed (set TOKENLANE_LM_EVAL to its lm_eval command)")
    return command


def test_lm_eval_multiple_choice_batch_size_4(serve, tiny_model_dir, tmp_path):
    command = _lm_eval_command()
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(textwrap.dedent(f"""\
        task: tokenlane_tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    live = serve()
    out_dir = tmp_path / "out"
    env = {**os.environ, "OPENAI_API_KEY": "EMPTY", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    model_args = (f"model=tiny,base_url={live.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tiny_model_dir},num_concurrent=1,max_retries=1")
    run = subprocess.run(
        [command, "--model", "local-completions", "--model_args", model_args, "--tasks", "tokenlane_tiny_mc",
         "--include_path", str(tmp_path), "--batch_size", "4", "--output_path", str(out_dir), "--log_samples"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tokenlane_tiny_mc" in run.stdout and "acc" in run.stdout
    # 6 questions x 4 choices, in lists of 4 prompts: 24 engine requests, none refused
    assert live.metric("tokenlane_requests_total", outcome="finished") == 24
    assert live.metric("tokenlane_requests_total", outcome="rejected") == 0

    # The recorded log-likelihoods are transformers' (lm-eval's own tokenization: the
    # context and context+continuation without special tokens, continuation = the rest).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(tiny_model_dir)
    (samples_file,) = out_dir.rglob("samples_tokenlane_tiny_mc_*.jsonl")
    checked = 0
    worst = 0.0
    for line in samples_file.read_text().splitlines():
        sample = json.loads(line)
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), resp in zip(pairs, sample["resps"]):
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            ctx = tokenizer(context, add_special_tokens=False).input_ids
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            expected = sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
            got = float(resp[0][0])
            worst = max(worst, abs(got - expected))
            assert got < 0 and len(whole) > len(ctx), (got, expected)
            checked += 1
    assert checked == 24
    assert worst < 1e-3, worst  # a sum of a few 1e-5-close terms
    print(f"\nlm-eval: 24 loglikelihoods (last {got:.6f}), max |lm-eval's - transformers'| = {worst:.2g}")
