"""`jaxpar train --objective grpo`: bad input refused in one line before anything compiles; a short run's figures.

Each refusal exits 2 with one line naming the record or the function, no traceback. The run: a user's reward
function and the built-in exact match on a toy sum task, data=4,tensor=2 with LoRA, two steps on one generation
batch: its JSON lines carry the rewards per function, the KL, the clip fraction and the completion lengths.
"""

import json
import sys

import pytest

from jaxpar.cli import main
from jaxpar.objectives import rewards

TINY = ["--model", "tiny", "--seq-len", "16", "--batch", "8", "--steps", "2", "--max-new-tokens", "4",
        "--mesh", "data=4,tensor=2"]


@pytest.fixture()
def task(tmp_path, monkeypatch):
    """A prompts file of sums and a module of reward functions, in the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "grpo_rewards.py").write_text(
        "def boom(prompts, completions, **kw):\n    return [1 / 0 for c in completions]\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def length(prompts, completions, answer, **kw):\n    return [float(len(c)) / 4 for c in completions]\n")
    yield tmp_path
    sys.modules.pop("grpo_rewards", None)


def refused(capsys, *argv) -> str:
    assert main(["train", *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--reward", "grpo_rewards:boom"], "reward function grpo_rewards:boom raised ZeroDivisionError"),
    (["--reward", "grpo_rewards:short"], "reward function grpo_rewards:short returned shape (1,) for 2 completions"),
    (["--reward", "grpo_rewards:missing"], "module 'grpo_rewards' has no function 'missing'"),
    (["--reward", "nowhere:f"], "module 'nowhere' cannot be imported"),
    (["--reward", "exact_answer", "--group-size", "3"], "--group-size 3 does not divide --batch 8"),
    (["--reward", "exact_answer", "--max-new-tokens", "14"], "prompts.jsonl line 1: its prompt is 4 tokens; with "
                                                            "--max-new-tokens 14 a row needs 18 > --seq 16"),
    (["--reward", "exact_answer", "--data", "x.txt"], "--data has no use in --objective grpo"),
    (["--reward", "exact_answer", "--zero", "3", "--mesh", "data=8"], "use --zero 0, 1 or 2"),
])
def test_bad_input_is_one_line(task, capsys, argv, message):
    err = refused(capsys, "--objective", "grpo", "--prompts", "prompts.jsonl", "--group-size", "2", *argv)
    assert message in err, err


def test_record_without_a_prompt_and_flags_without_grpo(task, capsys):
    (task / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    err = refused(capsys, "--objective", "grpo", "--prompts", "bad.jsonl", "--reward", "exact_answer")
    assert "bad.jsonl line 2: a prompt record needs a 'prompt' field" in err, err
    assert "--prompts is a flag of --objective grpo" in refused(capsys, "--prompts", "prompts.jsonl")


def test_built_in_rewards():
    assert rewards.exact_answer(None, ["so 3+4 = 7", "<answer>1,000</answer>", "#### 12", "none"],
                                ["7", "1000", "12.0", "3"]) == [1.0, 1.0, 1.0, 0.0]
    assert rewards.format_reward(None, ["<think>a</think> <answer>7</answer>", "7"]) == [1.0, 0.0]


def test_a_short_run_writes_the_figures(task, capsys):
    assert main(["train", *TINY, "--objective", "grpo", "--prompts", "prompts.jsonl", "--reward", "grpo_rewards:length",
                 "--reward", "exact_answer", "--group-size", "2", "--grpo-iterations", "2", "--beta", "0.1",
                 "--lora-rank", "4", "--temperature", "0.9", "--metrics", "m.jsonl"]) == 0
    rows = [json.loads(line) for line in (task / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["generation"] == rows[1]["generation"] == 0
    for name in ("reward", "reward_std", "rewards/grpo_rewards:length/mean", "rewards/exact_answer/mean", "kl",
                 "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio", "loss"):
        assert name in rows[1], name
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapters start at B = 0: the policy is its base
    assert "done: mean reward" in capsys.readouterr().out


def test_chat_prompts_are_rendered_with_the_template_and_stop_at_its_end_of_turn(tmp_path):
    from test_packing import tiny_tokenizer

    from jaxpar.data.prompts import read_prompts

    tokenizer = str(tiny_tokenizer(tmp_path))
    chat = [{"role": "user", "content": "what is 2 plus 3"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": chat, "answer": "5"}) + "\n")
    prompts = read_prompts(tmp_path / "chat.jsonl", tokenizer, 256, 32, 4)
    # <s> <|user|> what is 2 plus 3 <|end|> <|assistant|>: the template's BOS once, the generation header after
    words = ["<s>", "<|user|>", "what", "is", "2", "plus", "3", "<|end|>", "<|assistant|>"]
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert prompts.records[0].ids == tuple(vocab[w] for w in words)
    assert prompts.end_of_turn == vocab["<|end|>"] and prompts.records[0].fields == {"answer": "5"}
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"prompt": chat}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="mixed.jsonl line 2: prompts are all text or all chat messages"):
        read_prompts(tmp_path / "mixed.jsonl", tokenizer, 256, 32, 4)
