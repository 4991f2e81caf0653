"""The documents `--packing documents` packs: text documents, and fine-tuning records with their trained tokens.

A text document is its tokens with the tokenizer's BOS/EOS around it
(`jaxpar.data.tokenize.encode_documents`), every target trained. A
`prompt`/`completion` record is BOS + prompt + completion + EOS, trained on the
completion and the EOS. A `messages` record is rendered with the tokenizer's
chat template (`chat_template` of the `tokenizer_config.json` beside the
`tokenizer.json`; through `transformers`' `apply_chat_template` where
transformers is installed, else jinja2 with the same settings), trained on
each assistant reply and its end-of-turn marker only. Its roles are those chat
templates know (`jaxpar.data.sources.ROLES`); a conversation with no
assistant reply has nothing to train on and is skipped (an empty document,
which the packer drops), and counted in `LazyDocuments.skipped`.

The trained spans are the template's own where it marks them with
`{% generation %}` ... `{% endgeneration %}` (what transformers'
`return_assistant_tokens_mask` reads). Otherwise they are found by rendering
prefix by prefix: message i's span starts at the end of the render of
messages[:i] with the generation prompt, so none of the header that announces
the reply is trained, and ends with the end-of-turn marker: the first
whitespace-delimited piece the template writes after the reply (`<|im_end|>`,
not the newline ChatML writes after it). A template that does not render the
conversation prefix by prefix is refused by name. The text is then encoded
span by span, so no token straddles the edge between prompt and reply.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension

from jaxpar.data.tokenize import BYTES, Tokenizer, encode_documents, load_tokenizer
from jaxpar.data import sources
from jaxpar.data.record_index import RecordIndex
from jaxpar.data.packing import Document, split_stream


class LazyDocuments:
    """The documents of one `--data` source, read and tokenized by index range (`jaxpar.data.block_packing`).

    Opening it reads the source's index and checks every record
    (`jaxpar.data.record_index`), tokenizing none: the bad ones are left out and
    named in `bad`, for the run to refuse or skip. `documents(lo, hi)` reads
    records lo:hi and tokenizes them. `lo:hi` of a
    view (`view(lo, hi)`) is documents lo:hi of the source, so evaluation can
    hold out the last documents whole without reading the others.
    """

    def __init__(self, path: str, tokenizer_path: str | None, text_field: str = "text"):
        self.path, self.tokenizer_path = path, tokenizer_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        source = Path(path)
        self.kind = sources.record_kind(source) if sources.is_document_source(source) else sources.TEXT
        self.index = RecordIndex(source, text_field if self.kind == sources.TEXT else None)
        self.bad = self.index.check(self.kind)  # every record parsed and checked now; the bad ones left out
        self.chat = (ChatTemplate.of(tokenizer_path, f"--data {path!r} holds chat records (messages)")
                     if self.kind == sources.MESSAGES else None)
        self.lo, self.hi = 0, len(self.index)
        self.skipped: set[int] = set()  # conversations with no assistant reply, by record index (views share it)

    def __len__(self) -> int:
        return self.hi - self.lo

    def view(self, lo: int, hi: int) -> LazyDocuments:
        """Documents lo:hi of this one, unread."""
        out = copy.copy(self)
        out.lo, out.hi = self.lo + lo, self.lo + hi
        return out

    def documents(self, lo: int, hi: int) -> list[Document]:
        """Documents lo:hi, tokenized: text with BOS/EOS around each, or fine-tuning records with their masks."""
        lo, hi = self.lo + lo, self.lo + hi
        if self.kind == sources.TEXT:
            texts = self.index.texts(lo, hi)
            if self.tokenizer is BYTES and hi < len(self.index):  # bytes put "\n\n" after each document but the last
                return split_stream(*encode_documents([*texts, ""], self.tokenizer))[:-1]
            return split_stream(*encode_documents(texts, self.tokenizer))
        records = self.index.records(lo, hi, self.kind)
        if self.kind == sources.PROMPT_COMPLETION:
            return [prompt_completion(r["prompt"], r["completion"], self.tokenizer) for r in records]
        documents = []
        for i, record in zip(range(lo, hi), records):
            if not any(m["role"] == "assistant" for m in record["messages"]):
                self.skipped.add(i)
                documents.append(Document(np.zeros(0, np.int64)))
                continue
            documents.append(chat_document(record["messages"], self.chat, self.tokenizer, self.index.name(i)))
        return documents


def is_fine_tuning(path: str) -> bool:
    """Whether a `--data` source holds fine-tuning records (their loss needs --packing documents)."""
    source = Path(path)
    return sources.is_document_source(source) and sources.record_kind(source) != sources.TEXT


def encode_pieces(texts: list[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Each text's ids without what the tokenizer's post-processor adds to every text (a BOS, an EOS)."""
    ids = tokenizer.encode(["", *texts])
    added, out = ids[0].tolist(), []
    for piece in ids[1:]:
        piece = piece.tolist()
        for token in added:  # what encoding "" gives is added around every text: at the start, else the end
            if piece[:1] == [token]:
                piece = piece[1:]
            elif piece[-1:] == [token]:
                piece = piece[:-1]
        out.append(np.asarray(piece, np.int64))
    return out


def _document(pieces: list[np.ndarray], trained: list[bool]) -> Document:
    tokens = np.concatenate([np.asarray(p, np.int64) for p in pieces])
    mask = np.concatenate([np.full(len(p), float(t), np.float32) for p, t in zip(pieces, trained)])
    return Document(tokens, mask)


def prompt_completion(prompt: str, completion: str, tokenizer: Tokenizer) -> Document:
    """BOS + prompt + completion + EOS; the completion and the EOS are trained."""
    bos = [] if tokenizer.bos is None else [tokenizer.bos]
    eos = [] if tokenizer.eos is None else [tokenizer.eos]
    ids = encode_pieces([prompt, completion], tokenizer)
    return _document([np.asarray(bos), ids[0], ids[1], np.asarray(eos)], [False, False, True, True])


GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")  # transformers' mark of what the model generates
_MARK_OPEN, _MARK_CLOSE = "\ue000jaxpar-generation\ue001", "\ue000jaxpar-end-generation\ue001"


class ChatTemplate:
    """A tokenizer's chat template and its special tokens, rendered by transformers or jinja2."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", hf_tokenizer=None):
        self.template, self.bos_token, self.eos_token = template, bos_token, eos_token
        self.marked = bool(GENERATION.search(template))  # the template marks its replies with {% generation %}
        self._hf = None if self.marked else hf_tokenizer  # marked: jinja2 renders, so the marks give offsets
        self._jinja = None

    @classmethod
    def of(cls, tokenizer_path: str | None, what: str) -> ChatTemplate:
        """The chat template of the `tokenizer_config.json` beside `tokenizer_path`; ValueError names what is missing."""
        if tokenizer_path is None:
            raise ValueError(f"{what}; rendering them needs --tokenizer (a tokenizer.json with a chat_template in the "
                             "tokenizer_config.json beside it)")
        config_path = Path(tokenizer_path).with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{what}, but {config_path} has no chat_template; add one (the model's own, from its "
                             "Hugging Face repository) or write the records as prompt/completion")
        special = [config.get(f"{k}_token") for k in ("bos", "eos")]
        special = [(t.get("content") if isinstance(t, dict) else t) or "" for t in special]
        return cls(template, *special, hf_tokenizer=_hf_tokenizer(config_path.parent, template))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._marked(messages, add_generation_prompt).replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")

    def _marked(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The render, with each `{% generation %}` block between the two marks."""
        if self._hf is not None:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        if self._jinja is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(f"the chat template refused the messages: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationMarks])
            env.globals["raise_exception"] = raise_exception
            self._jinja = env.from_string(self.template)
        return self._jinja.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token, eos_token=self.eos_token)

    def end_of_turn(self, tokenizer: Tokenizer) -> int | None:
        """The token that ends an assistant reply: the first of what the template writes after one (the
        tokenizer's EOS where it writes nothing, or only space)."""
        reply = "jaxpar-reply"
        text, [(start, end)] = self.assistant_spans([{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": reply}], "the chat template")
        written = text[start:end]
        after = written[written.rindex(reply) + len(reply):].strip() if reply in written else ""
        ids = encode_pieces([after], tokenizer)[0] if after else []
        return int(ids[0]) if len(ids) else tokenizer.eos

    def assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans of its assistant replies with their end-of-turn
        markers): the template's `{% generation %}` blocks where it has them, else found prefix by prefix."""
        if self.marked:
            return _generation_spans(self._marked(messages, False))
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.render(messages[:i], add_generation_prompt=True), self.render(messages[:i + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise ValueError(f"{where}: the chat template does not render the conversation prefix by prefix, "
                                 "so its assistant tokens cannot be found; write the records as prompt/completion")
            spans.append((len(before), _through_marker(text, len(before), len(through), message["content"])))
        return text, spans


def _through_marker(text: str, start: int, end: int, reply: str) -> int:
    """Where the reply written in text[start:end] ends with its end-of-turn marker: the first whitespace-delimited
    piece after the reply, so what the template writes after the marker (ChatML's newline) is not trained."""
    written = text[start:end]
    reply_end = start + written.rindex(reply) + len(reply) if reply and reply in written else start
    after = text[reply_end:end]
    marker = after.lstrip()
    marker = marker.split(maxsplit=1)[0] if marker.strip() else ""
    return reply_end + (len(after) - len(after.lstrip()) if marker else 0) + len(marker)


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """(the render without the marks, the character span of each `{% generation %}` block)."""
    text, spans, at = [], [], 0
    for piece in re.split(f"({_MARK_OPEN}|{_MARK_CLOSE})", marked):
        if piece == _MARK_OPEN:
            spans.append([at, at])
        elif piece == _MARK_CLOSE:
            spans[-1][1] = at
        else:
            text.append(piece)
            at += len(piece)
    return "".join(text), [tuple(span) for span in spans]


class _GenerationMarks(Extension):
    """jinja2's reading of `{% generation %}` ... `{% endgeneration %}`: the block, between two marks."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return f"{_MARK_OPEN}{caller()}{_MARK_CLOSE}"


def _hf_tokenizer(folder: Path, template: str):
    """transformers' tokenizer of a folder with tokenizer.json, or None where transformers cannot load it."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder), chat_template=template)
    except Exception:  # noqa: BLE001 - a folder transformers cannot read: jinja2 renders the template instead
        return None


def chat_document(messages: list[dict], chat: ChatTemplate, tokenizer: Tokenizer, where: str) -> Document:
    """A conversation rendered by `chat`, its assistant spans trained; encoded span by span."""
    text, spans = chat.assistant_spans(messages, where)
    edges = sorted({0, len(text), *(e for span in spans for e in span)})
    parts = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    trained = [any(s <= a and b <= e for s, e in spans) for a, b in parts]
    return _document(encode_pieces([text[a:b] for a, b in parts], tokenizer), trained)
