"""`jaxpar train --objective`: bad preference records and options refused in one line before compiling, chat
records trained on their answers only, the README's three-command LoRA DPO on a chat model (train with its figures,
export a PEFT adapter, generate), and LoRA-DPO holding no second copy of the base."""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main
from jaxpar.interop import hf_write
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.data import preference
from jaxpar.data.records import ChatTemplate
from jaxpar.data.tokenize import load_tokenizer
from test_packing import tiny_tokenizer

README = Path(__file__).resolve().parent.parent / "README.md"
COMMON = ["train", "--steps", "1", "--batch-size", "8", "--seq-len", "32", "--mesh", "data=8"]


def records(path, count=16, change=None):
    with open(path, "w") as f:
        for i in range(count):
            record = {"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"}
            record.update((change or {}).get(i, {}))
            f.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
    return path


@pytest.mark.parametrize("change,flags,message", [
    ({2: {"chosen": None}}, ["--lora-rank", "4"], "record 3 (line 3 of "),
    ({2: {"chosen": None}}, ["--lora-rank", "4"], "has no 'chosen' (a preference record holds prompt, chosen and"),
    ({4: {"prompt": "x" * 40}}, ["--lora-rank", "4"], "record 5 (line 5 of"),
    ({4: {"prompt": "x" * 40}}, ["--lora-rank", "4"], "more than a row of seq_len 32 + 1 holds"),
    ({}, [], "DPO without LoRA needs its reference's log-probs: add --precompute-reference"),
    ({}, ["--lora-rank", "4", "--label-smoothing", "0.1"], "--label-smoothing 0.1 acts only on --dpo-loss robust"),
    ({}, ["--lora-rank", "4", "--dpo-loss", "kto"], "--dpo-loss 'kto' is not one of sigmoid, ipo, hinge, robust"),
    ({}, ["--lora-rank", "4", "--objective", "grpo2"], "--objective 'grpo2' is not one of"),
    ({}, ["--mesh", "data=4,pipe=2", "--lora-rank", "4"], "DPO under a pipeline (pipe > 1) takes its reference with"),
])
def test_bad_preference_input_is_one_line_before_compiling(tmp_path, capsys, change, flags, message):
    path = records(tmp_path / "prefs.jsonl", change=change)
    objective = [] if "--objective" in flags else ["--objective", "dpo"]
    code = main([*COMMON, "--data", str(path), *objective, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and err.startswith("error:"), err
    assert message in " ".join(err.split())


def test_chat_records_train_only_the_final_answers(tmp_path):
    tokenizer_path = tiny_tokenizer(tmp_path)
    tokenizer, chat = load_tokenizer(str(tokenizer_path)), ChatTemplate.of(str(tokenizer_path), "chat records")
    record = {"prompt": [{"role": "user", "content": "what is 2 plus 3"}],
              "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]}
    chosen, rejected = preference.pair_documents(record, "record 1", tokenizer, chat)
    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "what", "is", "plus", "it",
             *map(str, range(200))]
    trained = [[words[t] for t, m in zip(d.tokens, d.mask) if m] for d in (chosen, rejected)]
    assert trained == [["5", "<|end|>"], ["6", "<|end|>"]]  # the final answer and its end of turn, nothing before
    assert list(chosen.tokens[:len(chosen.tokens) - 2]) == list(rejected.tokens[:len(rejected.tokens) - 2])
    with pytest.raises(ValueError, match="record 1: prompt, chosen and rejected must be all strings or all lists"):
        preference.pair_documents({**record, "prompt": "hi"}, "record 1", tokenizer, chat)


def readme_commands() -> list[list[str]]:
    """The three `jaxpar` lines of the README's DPO block, as argument lists."""
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("### Preference tuning"):], re.S).group(1)
    return [shlex.split(line)[1:] for line in block.strip().splitlines()]


def tiny_chat_base(folder: Path) -> None:
    """A random tiny Llama written as a Hugging Face folder by jaxpar, with a word-level chat tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "what", "is", "plus", "it",
             *map(str, range(100))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"])
    cfg = LlamaConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=64)
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, nnx.Rngs(0))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(model)), cfg, folder)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}<|end|>"
                "{% else %}<|assistant|>{% generation %}{{ m.content }}<|end|>{% endgeneration %}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": template}))


def test_the_readmes_lora_dpo_on_a_chat_model_runs_and_reports_its_figures(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_chat_base(base)
    prefs = [{"prompt": [{"role": "user", "content": f"what is {i} plus {i}"}],
              "chosen": [{"role": "assistant", "content": f"it is {2 * i}"}],
              "rejected": [{"role": "assistant", "content": f"it is {2 * i + 1}"}]} for i in range(24)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prefs))
    smaller = {"--steps": "2", "--seq-len": "32", "--max-new-tokens": "4"}  # this machine's share of the run

    def adjusted(argv):
        out = [smaller.get(argv[i - 1], arg) if i else arg for i, arg in enumerate(argv)]
        out = [arg.replace("./Qwen2.5-0.5B-Instruct", str(base)) for arg in out]
        return [str(tmp_path / arg) if i and out[i - 1] in ("--data", "--checkpoint-dir", "--out") else arg
                for i, arg in enumerate(out)]

    train, export, generate = (adjusted(argv) for argv in readme_commands())
    assert "--objective" in train and "--lora-rank" in train and "peft" in export and "--chat" in generate
    metrics = tmp_path / "m.jsonl"
    assert main([*train, "--metrics", str(metrics), "--tensorboard", str(tmp_path / "tb")]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {"chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy"} <= set(rows[0])
    assert abs(rows[0]["loss"] - np.log(2)) <= 1e-6  # B = 0: the policy is its base, every margin 0
    assert rows[0]["reward_margin"] == 0.0
    assert main(export) == 0, capsys.readouterr().err
    assert (tmp_path / "dpo-adapter" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert main([*generate, "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def inspected(capsys, *flags) -> dict:
    assert main(["inspect", "--batch-size", "8", "--seq-len", "32", "--mesh", "data=8", "--zero", "3",
                 "--lora-rank", "4", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_lora_dpo_holds_no_second_copy_of_the_base(tmp_path, capsys):
    path = records(tmp_path / "prefs.jsonl")
    sft = inspected(capsys)
    dpo = inspected(capsys, "--objective", "dpo", "--data", str(path))
    assert abs(dpo["memory"]["arguments"] / sft["memory"]["arguments"] - 1) <= 0.02, (dpo["memory"], sft["memory"])
