"""Real tokenizers for `jaxpar tokenize` and `jaxpar train --tokenizer`: SentencePiece and tokenizer.json, and the header checks."""

import json

import numpy as np
import pytest
import sentencepiece
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jaxpar.cli import main
from jaxpar.data.tokens import default_corpus
from jaxpar.core.plan import Plan
from jaxpar.data.tokenize import training_tokens
from jaxpar.run.training import TrainConfig, prepare

TINY_VOCAB = 256  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A folder of two text files, a SentencePiece model (vocab 120) and a BPE tokenizer.json (vocab 400), trained on it."""
    tmp = tmp_path_factory.mktemp("tok")
    text = default_corpus()[:60_000].tobytes().decode("utf-8", errors="ignore")
    (tmp / "text").mkdir()
    (tmp / "text" / "a.txt").write_text(text[:30_000])
    (tmp / "text" / "b.md").write_text(text[30_000:] + " naïve café ✓")
    sentencepiece.SentencePieceTrainer.train(input=str(tmp / "text" / "a.txt"), model_prefix=str(tmp / "sp"),
                                             vocab_size=120, model_type="bpe", minloglevel=2)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], show_progress=False))
    bpe.save(str(tmp / "bpe-tokenizer.json"))
    return tmp


def tokenize(files, name, tokenizer, capsys):
    out = files / f"{name}.npy"
    assert main(["tokenize", str(files / "text"), "--out", str(out), *(["--tokenizer", str(tokenizer)] if tokenizer else [])]) == 0
    header = json.loads(capsys.readouterr().out)
    assert json.loads(out.with_suffix(".json").read_text()) == {k: v for k, v in header.items() if k != "path"}
    return np.load(out), header


def test_sentencepiece_and_tokenizer_json_tokenize_as_their_libraries_do(files, capsys):
    texts = [(files / "text" / name).read_text() for name in ("a.txt", "b.md")]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(files / "sp.model"))
    ids, header = tokenize(files, "sp", files / "sp.model", capsys)
    assert header["tokenizer"] == "sentencepiece" and header["vocab"] == 120 and header["dtype"] == "uint8"
    assert ids.tolist() == sp.encode(texts[0]) + sp.encode(texts[1])
    assert len(header["tokenizer_sha256"]) == 64 and header["files"] == 2
    ids, header = tokenize(files, "bpe", files / "bpe-tokenizer.json", capsys)
    bpe = Tokenizer.from_file(str(files / "bpe-tokenizer.json"))
    assert header["tokenizer"] == "tokenizer.json" and header["vocab"] == 400 and header["dtype"] == "uint16"
    assert ids.tolist() == bpe.encode(texts[0]).ids + bpe.encode(texts[1]).ids


def test_train_tokenizes_text_as_tokenize_does(files, capsys):
    ids, _ = tokenize(files, "sp2", files / "sp.model", capsys)
    assert np.array_equal(training_tokens(str(files / "text"), str(files / "sp.model"), TINY_VOCAB), ids)
    assert np.array_equal(training_tokens(str(files / "sp2.npy"), str(files / "sp.model"), TINY_VOCAB), ids)
    run = prepare(TrainConfig(steps=1, batch_size=8, seq_len=16, data=str(files / "text"), packing="windows",
                              tokenizer=str(files / "sp.model")), Plan.create("data=8"))  # windows of the stream
    assert np.array_equal(run.batches.tokens, ids) and run.batches[0]["inputs"].max() < 120
    corpus = training_tokens(None, str(files / "sp.model"), TINY_VOCAB)  # the built-in corpus, tokenized
    assert corpus.dtype == np.uint8 and corpus.size < default_corpus().size


def refused(args, capsys) -> str:
    assert main(["train", "--steps", "1", *map(str, args)]) == 2
    return " ".join(capsys.readouterr().err.split())


def test_a_tokenizer_larger_than_the_model_is_refused(files, capsys):
    err = refused(["--tokenizer", files / "bpe-tokenizer.json", "--data", files / "text"], capsys)
    assert "vocabulary of 400 tokens but the model's has 256" in err
    tokenize(files, "bpe2", files / "bpe-tokenizer.json", capsys)
    err = refused(["--data", files / "bpe2.npy"], capsys)  # the header says so before any id is scanned
    assert "tokenized with a vocabulary of 400 tokens (tokenizer.json" in err and "the model's has 256" in err


def test_token_file_headers_are_checked(files, capsys):
    tokenize(files, "bytes", None, capsys)
    err = refused(["--data", files / "bytes.npy", "--tokenizer", files / "sp.model"], capsys)
    assert "tokenized with another tokenizer (bytes, vocab 256) than --tokenizer (sentencepiece" in err
    header = json.loads((files / "bytes.json").read_text())
    (files / "bytes.json").write_text(json.dumps({**header, "dtype": "uint16"}))
    assert "holds uint8 ids but its header bytes.json says uint16" in refused(["--data", files / "bytes.npy"], capsys)
    np.save(files / "bare.npy", np.arange(100, dtype=np.uint8))
    assert "has no header (bare.json) to check against --tokenizer" in refused(
        ["--data", files / "bare.npy", "--tokenizer", files / "sp.model"], capsys)
    np.arange(100, dtype="<u2").tofile(files / "t.bin")
    assert "a .bin token file has no header" in refused(["--data", files / "t.bin", "--tokenizer", files / "sp.model"], capsys)
    (files / "not.model").write_bytes(b"nonsense")
    assert "is not a readable SentencePiece model" in refused(["--tokenizer", files / "not.model"], capsys)
    assert "expected a Hugging Face tokenizer.json or a SentencePiece .model" in refused(
        ["--tokenizer", files / "text" / "a.txt"], capsys)


def test_tokenize_never_overwrites(files, capsys):
    (files / "tokenizer.json").write_text((files / "bpe-tokenizer.json").read_text())
    assert main(["tokenize", str(files / "text"), "--out", str(files / "tokenizer.npy"),
                 "--tokenizer", str(files / "tokenizer.json")]) == 2
    assert "tokenizer.json' already exists" in capsys.readouterr().err
    assert (files / "tokenizer.json").read_text() == (files / "bpe-tokenizer.json").read_text()


def test_generate_encodes_and_decodes_with_either_tokenizer(files):
    """`jaxpar generate --tokenizer` (and eval's) codec: the library's own ids, decoded back to the text."""
    from jaxpar.run.generate import text_codec

    sp = sentencepiece.SentencePieceProcessor(model_file=str(files / "sp.model"))
    encode, decode = text_codec(str(files / "sp.model"), TINY_VOCAB)
    text = "the language reference"
    assert encode(text) == sp.encode(text) and decode(encode(text)) == sp.decode(sp.encode(text))
    encode, decode = text_codec(None, TINY_VOCAB)
    assert encode("café") == list("café".encode("utf-8")) and decode(encode("café")) == "café"
    with pytest.raises(ValueError, match="vocabulary of 400 tokens but the model's has 256"):
        text_codec(str(files / "bpe-tokenizer.json"), TINY_VOCAB)
    encode, decode = text_codec(str(files / "bpe-tokenizer.json"), 512)
    assert decode(encode("the language reference")) == Tokenizer.from_file(str(files / "bpe-tokenizer.json")).decode(
        encode("the language reference"))
