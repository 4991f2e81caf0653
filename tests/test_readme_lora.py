"""The README's three-command LoRA fine-tune, run as written on a tiny Qwen2 made by transformers (its steps, sequence
length and prompt length cut to this machine): train on chat records, export a PEFT adapter, `generate --chat`. The
reply equals the one `peft` generates greedily from the exported adapter on the same base, token for token."""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

README = Path(__file__).resolve().parent.parent / "README.md"
BASE = "./Qwen2.5-0.5B-Instruct"
SMALLER = {"--steps": "6", "--seq-len": "32", "--max-new-tokens": "6"}  # this machine's share of the README's run


def readme_commands() -> list[list[str]]:
    """The three `jaxpar` lines of the README's LoRA fine-tune block, as argument lists."""
    text = README.read_text()
    block = text[text.index("### LoRA fine-tuning"):]
    block = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    return [shlex.split(line)[1:] for line in block.strip().splitlines()]


def adjusted(argv: list[str], base: Path, work: Path) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in SMALLER:
            arg = SMALLER[argv[i - 1]]
        arg = arg.replace(BASE, str(base))
        if i and argv[i - 1] in ("--data", "--checkpoint-dir", "--out"):
            arg = str(work / arg)
        out.append(arg)
    return out


def tiny_chat_base(folder: Path) -> None:
    """A random Qwen2 with a word-level tokenizer whose tokenizer_config.json holds a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "what", "is", "plus", "it",
             *map(str, range(100))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}<|end|>"
                "{% else %}<|assistant|>{% generation %}{{ m.content }}<|end|>{% endgeneration %}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": template}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)


def test_the_readmes_lora_fine_tune_runs_and_generates_as_peft_does(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_chat_base(base)
    chats = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                           {"role": "assistant", "content": f"it is {2 * i}"}]} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    train, export, generate = (adjusted(argv, base, tmp_path) for argv in readme_commands())
    assert train[0] == "train" and "--lora-rank" in train and export[:1] == ["export"] and "--chat" in generate

    assert main(train) == 0, capsys.readouterr().err
    assert main(export) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*generate, "--json"]) == 0, capsys.readouterr().err
    reply = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    adapter = tmp_path / export[export.index("--out") + 1]
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    assert float(np.abs(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
                        .detach().numpy()).max()) > 0  # the adapters trained
    prompt = torch.tensor(reply["prompt_tokens"])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=int(SMALLER["--max-new-tokens"]), eos_token_id=reply["eos"],
                             pad_token_id=reply["eos"])
    ours, theirs = (upto_eos(row, reply["eos"]) for row in (reply["tokens"][0], out[0, prompt.shape[1]:].tolist()))
    print(f"prompt {reply['prompt_tokens'][0]}; jaxpar {ours}; peft {theirs}")
    assert ours == theirs


def upto_eos(row: list[int], eos: int) -> list[int]:
    return row[:row.index(eos) + 1] if eos in row else row
