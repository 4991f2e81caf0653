"""Prompt records for reinforcement learning (`--prompts`): JSON lines as TRL's GRPOTrainer reads them.

Each record has a `prompt`: plain text, or a conversation (a list of `{"role", "content"}` messages) rendered by
the tokenizer's chat template with the assistant's header after it. Every other field (`answer`, ...) is kept
and handed to the reward functions by name, as TRL hands a dataset's columns. All records are read, tokenized
and checked before anything compiles: a record without a prompt, or one whose prompt and `max_new_tokens`
do not fit the sequence, is refused in one line that names it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxpar.data.tokenize import Tokenizer, check_covers, load_tokenizer


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One record: its line number (1-based), the prompt as given, its token ids and its other fields."""

    line: int
    prompt: str | list
    ids: tuple[int, ...]
    fields: dict


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A prompt file's records, and what turns text into ids and back."""

    path: str
    records: list[PromptRecord]
    tokenizer: Tokenizer
    end_of_turn: int | None  # a chat template's end of an assistant reply (None for plain-text prompts)

    def where(self, record: PromptRecord) -> str:
        return f"{self.path} line {record.line}"


def _records(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of each non-empty line; a line that is not a JSON object is refused by number."""
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r} is not a file (JSON lines, one {{\"prompt\": ...}} per line)")
    out = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise ValueError(f"{path} line {number}: a prompt record needs a 'prompt' field (text or chat messages), "
                             f"got {sorted(record) if isinstance(record, dict) else type(record).__name__}")
        out.append((number, record))
    if not out:
        raise ValueError(f"--prompts {path} holds no records")
    return out


def _texts(path: Path, rows: list[tuple[int, dict]], tokenizer: str | None) -> tuple[list[str], int | None]:
    """Each record's prompt as the text the model reads, and the end-of-turn token of a chat template."""
    chats = [isinstance(r["prompt"], list) for _, r in rows]
    if any(chats) and not all(chats):
        first = rows[chats.index(not chats[0])][0]
        raise ValueError(f"{path} line {first}: prompts are all text or all chat messages, not both")
    for number, record in rows:
        prompt = record["prompt"]
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt))
        if not ok or not prompt:
            raise ValueError(f"{path} line {number}: 'prompt' must be non-empty text or a list of "
                             "{\"role\", \"content\"} messages")
    if not chats[0]:
        return [r["prompt"] for _, r in rows], None
    from jaxpar.data.records import ChatTemplate

    template = ChatTemplate.of(tokenizer, "--prompts holds chat messages, rendered with the tokenizer's chat template")
    texts = [template.render(r["prompt"], add_generation_prompt=True) for _, r in rows]
    return texts, template.end_of_turn(load_tokenizer(tokenizer))


def read_prompts(path, tokenizer: str | None, vocab: int, seq_len: int, max_new_tokens: int) -> Prompts:
    """Every record of `path`, tokenized (UTF-8 bytes without a tokenizer) and checked against the sequence."""
    from jaxpar.data.records import encode_pieces

    path = Path(path)
    rows = _records(path)
    texts, end_of_turn = _texts(path, rows, tokenizer)
    loaded = load_tokenizer(tokenizer)
    check_covers(loaded, vocab, "--tokenizer" if tokenizer else "byte tokens")
    ids = encode_pieces(texts, loaded) if end_of_turn is not None else loaded.encode(texts)
    records = []
    for (number, record), tokens in zip(rows, ids):
        tokens = tuple(int(t) for t in tokens)
        if loaded.bos is not None and end_of_turn is None and tokens[:1] != (loaded.bos,):
            tokens = (loaded.bos, *tokens)
        if len(tokens) + max_new_tokens > seq_len:
            raise ValueError(f"{path} line {number}: its prompt is {len(tokens)} tokens; with --max-new-tokens "
                             f"{max_new_tokens} a row needs {len(tokens) + max_new_tokens} > --seq {seq_len}")
        fields = {k: v for k, v in record.items() if k != "prompt"}
        records.append(PromptRecord(number, record["prompt"], tokens, fields))
    return Prompts(str(path), records, loaded, end_of_turn)
