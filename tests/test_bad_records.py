"""The data path's defects as a new user meets them (issue 46): chat records as the template means them, a binary
`.jsonl`, the closing line of a one-step run, and the metrics file of a resumed run."""

import json
import types

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data import records
from jaxpar.data.tokenize import BYTES
from jaxpar.run.report import closing_line
from jaxpar.run.training import Outputs
from jaxpar.data.block_packing import BlockBatches

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_file(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def conversation(i, roles=("user", "assistant")):
    return [{"role": role, "content": f"{role} says {i}"} for role in roles]


@pytest.fixture
def chatml():
    return records.ChatTemplate(CHATML)


def trained(doc) -> list[str]:
    """The trained runs of a byte-tokenized document's text."""
    text = "".join(chr(t) if m else "\0" for t, m in zip(doc.tokens, doc.mask))
    return [run for run in text.split("\0") if run]


# -- defect 2: roles no template knows are refused by name, with the record's 1-based line ---------------------


@pytest.mark.parametrize("role", ["human", "bot"])
def test_a_role_the_template_does_not_know_is_refused_by_name_and_1_based_line(tmp_path, role):
    conversations = [conversation(i) for i in range(40)]
    conversations[29] = conversation(29, ("user", role))  # the 30th record, line 30
    path = chat_file(tmp_path / "chat.jsonl", conversations)
    index = records.RecordIndex(path, None)
    with pytest.raises(ValueError) as error:
        index.records(0, len(index), "messages")
    message = str(error.value)
    assert message == (f"--data {str(path)!r} line 30: message 2 has role {role!r}, which chat templates do not "
                       "know; use one of user, assistant, system, tool")
    assert "\n" not in message and "no 'assistant' message" not in message


def test_a_parquet_record_is_named_by_its_1_based_number(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversations = [conversation(i) for i in range(5)]
    conversations[2] = conversation(2, ("human", "assistant"))
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": conversations}), path)
    index = records.RecordIndex(path, None)
    with pytest.raises(ValueError, match=r"chat.parquet' record 3: message 1 has role 'human'"):
        index.records(0, 5, "messages")


def test_train_refuses_an_unknown_role_in_one_line_before_compiling(tmp_path, capsys):
    path = chat_file(tmp_path / "chat.jsonl", [conversation(0), conversation(1, ("human", "assistant"))])
    folder = tmp_path / "tok"
    folder.mkdir()
    from test_packing import tiny_tokenizer

    code = main(["train", "--steps", "1", "--batch-size", "8", "--seq-len", "16", "--data", str(path),
                 "--tokenizer", str(tiny_tokenizer(folder))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    assert "chat.jsonl' line 2: message 1 has role 'human'" in " ".join(err.split())


# -- defect 3: the loss weights each reply and its end-of-turn marker, nothing the template writes after it -----


def test_chatml_trains_each_reply_and_its_im_end_not_the_newline_after(chatml):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    doc = records.chat_document(messages, chatml, BYTES, "line 1")
    assert trained(doc) == ["hello there<|im_end|>", "4<|im_end|>"]
    assert doc.mask.sum() == len("hello there<|im_end|>") + len("4<|im_end|>")
    text = bytes(doc.tokens.astype(np.uint8)).decode()
    assert text.endswith("4<|im_end|>\n") and not doc.mask[-1]  # the newline is written, not trained


def test_chatml_weighted_tokens_equal_the_replies_and_their_markers(chatml):
    """The weighted targets of ChatML conversations are exactly their replies plus one `<|im_end|>` each."""
    conversations = [conversation(i, ("system", "user", "assistant", "user", "assistant")) for i in range(50)]
    docs = [records.chat_document(c, chatml, BYTES, f"line {i + 1}") for i, c in enumerate(conversations)]
    weighted = sum(float(d.mask.sum()) for d in docs)
    replies = sum(len(m["content"]) + len("<|im_end|>") for c in conversations for m in c if m["role"] == "assistant")
    assert weighted == replies == 2 * (10 * 16 + 40 * 17) + 100 * len("<|im_end|>")  # replies of 16 and 17 bytes


def test_generation_markers_are_the_trained_spans(chatml):
    """A template with `{% generation %}` is trained on its marked blocks, even where they hold the newline."""
    marked = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}{% if m.role == 'assistant' %}"
              "{% generation %}{{ m.content + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
              "{{ m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]
    template = records.ChatTemplate(marked)
    doc = records.chat_document(messages, template, BYTES, "line 1")
    assert template.marked and trained(doc) == ["yo<|im_end|>\n", "fine<|im_end|>\n"]
    assert doc.mask.sum() == len("yo<|im_end|>\n") + len("fine<|im_end|>\n")
    assert template.render(messages) == bytes(doc.tokens.astype(np.uint8)).decode()


def test_generation_markers_match_transformers_assistant_mask(tmp_path):
    """Token for token, the mask transformers' `return_assistant_tokens_mask` reads from the same template."""
    transformers = pytest.importorskip("transformers")
    from jaxpar.data.tokenize import load_tokenizer
    from test_packing import tiny_tokenizer

    marked = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }} <|end|>{% endgeneration %}{% else %}{{ m.content }} <|end|>{% endif %}{% endfor %}")
    path = tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": marked}))
    messages = [{"role": "user", "content": "what is 2 plus 2"}, {"role": "assistant", "content": "it is 4"},
                {"role": "user", "content": "what is 3"}, {"role": "assistant", "content": "3"}]
    doc = records.chat_document(messages, records.ChatTemplate.of(str(path), "test"), load_tokenizer(str(path)), "x")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    np.testing.assert_array_equal(doc.tokens, out["input_ids"])
    np.testing.assert_array_equal(doc.mask, out["assistant_masks"])


# -- defect 4: a conversation with no reply is skipped and counted, the file trains --------------------------------


def test_a_conversation_without_a_reply_is_skipped_and_counted(tmp_path):
    from test_packing import tiny_tokenizer

    words = {"user": "what is", "assistant": "it is", "system": "plus"}
    conversations = [[{"role": r, "content": f"{words[r]} {i}"} for r in ("user", "assistant")] for i in range(12)]
    conversations[4] = [{"role": "system", "content": "plus"}, {"role": "user", "content": "what is 4"}]
    conversations[9] = [{"role": "user", "content": "what is 9"}]
    path = chat_file(tmp_path / "chat.jsonl", conversations)
    documents = records.LazyDocuments(str(path), str(tiny_tokenizer(tmp_path)))
    docs = documents.documents(0, 12)
    assert [len(d.tokens) == 0 for d in docs] == [i in (4, 9) for i in range(12)]
    assert documents.skipped == {4, 9} and all(d.mask.sum() == 4 for i, d in enumerate(docs) if i not in (4, 9))
    batches = BlockBatches(documents, batch_size=2, seq_len=32, block_documents=4)
    assert batches.rows_per_epoch == 2 + 1 + 1  # conversations of 11 tokens, 3 to a row of 33; blocks of 4, 3, 3
    run = types.SimpleNamespace(config=types.SimpleNamespace(batch_size=2, seq_len=32), batches=batches,
                                mfu=types.SimpleNamespace(peak=None, why_not="n/a (CPU)"))
    assert "; 2 conversations with no assistant reply skipped" in closing_line(run, [1.0, 0.5], [9.0, 0.1])
    none = records.LazyDocuments(str(chat_file(tmp_path / "none.jsonl", [conversations[4], conversations[9]])),
                                 str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="none.jsonl' has nothing to train on: its 2 documents pack into no rows"):
        BlockBatches(none, batch_size=2, seq_len=32, name=none.path).rows(0)


# -- defect 5: a binary file named .jsonl is refused naming the file and the line ----------------------------------


def test_a_binary_jsonl_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n\n' + b'{"text": "\xd0\xd0 broken"}\n')
    assert records.LazyDocuments(str(path), None).bad == [
        f"--data {str(path)!r} line 4 is not UTF-8 text (byte 0xd0 at column 11: invalid continuation byte); "
        "a .jsonl file holds one JSON object per line"]
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(200, 256)) * 4)
    with pytest.raises(ValueError, match=rf"binary.jsonl' line 1 is not UTF-8 text \(byte 0xc8 at column 1"):
        records.LazyDocuments(str(binary), None)


def test_train_on_a_binary_jsonl_is_one_line(tmp_path, capsys):
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(range(128, 256)) + b"\n")
    assert main(["train", "--steps", "1", "--batch-size", "8", "--seq-len", "16", "--data", str(binary)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "binary.jsonl' line 1 is not UTF-8 text" in err and "Traceback" not in err


# -- defect 6: the closing line's median leaves out the compile step -----------------------------------------------


def test_the_closing_line_leaves_out_the_compile_step():
    run = types.SimpleNamespace(config=types.SimpleNamespace(batch_size=4, seq_len=8), batches=None,
                                mfu=types.SimpleNamespace(peak=None, why_not="n/a (CPU)"))
    one = closing_line(run, [2.0], [8.4746])
    assert "median" not in one and "8474.6 ms includes compiling" in one and "over 1 step;" in one
    many = closing_line(run, [2.0, 1.5, 1.2, 1.0], [8.0, 0.030, 0.010, 0.020])
    assert "median step 20.0 ms (compile step left out), 1,600 tok/s" in many


# -- defect 7: after a kill and a resume, the metrics file holds each step once -------------------------------------


def test_a_resumed_run_keeps_each_metrics_row_once(tmp_path):
    metrics = tmp_path / "m.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 16)]
    metrics.write_text("\n".join(rows) + "\n" + '{"step": 16, "lo')  # killed after step 15, mid-row
    outputs = Outputs(str(metrics), None, start=10)  # the checkpoint of step 10
    for step in range(11, 18):
        outputs.write({"step": step, "loss": 0.0})
    outputs.close()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 18))
    assert [json.loads(line)["loss"] for line in metrics.read_text().splitlines()][9:11] == [0.1, 0.0]


def test_train_killed_after_its_last_save_and_resumed_writes_each_step_once(tmp_path, capsys):
    """Steps 3 and 4 ran after the checkpoint of step 2, then the run died: the resume redoes them, once each."""
    import shutil

    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ck"
    common = ["train", "--batch-size", "8", "--seq-len", "16", "--checkpoint-dir", str(directory), "--metrics",
              str(metrics), "--save-every", "2"]
    assert main([*common, "--steps", "4"]) == 0
    shutil.rmtree(directory / "4")  # as if killed before step 4's save
    with metrics.open("a") as f:
        f.write('{"step": 5, "lo')  # and mid-row
    assert main([*common, "--steps", "4"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]


# -- defect 1: every bad record is caught before the run spends compute on it --------------------------------------


def documents_file(path, count, bad_lines=(), bad=b'{"text": "cut off'):
    lines = [json.dumps({"text": f"document number {i}"}).encode() for i in range(count)]
    for number in bad_lines:
        lines[number - 1] = bad
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_malformed_line_past_the_first_block_is_refused_at_start_up(tmp_path, capsys):
    path = documents_file(tmp_path / "docs.jsonl", 1200, bad_lines=(1001,))
    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ck"
    code = main(["train", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--data", str(path),
                 "--metrics", str(metrics), "--checkpoint-dir", str(directory)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and not metrics.exists() and not any(directory.glob("*"))
    assert " ".join(err.split()) == (f"error: --data {str(path)!r} line 1001 is not JSON (Unterminated string starting at: "
                                     "column 10); fix the data, or train without the bad records: --skip-bad-records")


def test_bad_records_are_left_out_in_place_and_counted(tmp_path):
    path = documents_file(tmp_path / "docs.jsonl", 12, bad_lines=(3, 8))
    lines = path.read_bytes().split(b"\n")
    lines[9] = json.dumps({"body": "no text field"}).encode()  # line 10
    path.write_bytes(b"\n".join(lines))
    documents = records.LazyDocuments(str(path), None)
    assert len(documents) == 9 and len(documents.bad) == 3
    assert documents.bad[0].endswith("line 3 is not JSON (Unterminated string starting at: column 10)")
    assert documents.bad[2].endswith("line 10 has no field 'text' (it has 'body'); choose the field with DataSpec(text_field=...)")
    texts = [bytes(d.tokens.astype(np.uint8)).decode().strip() for d in documents.documents(0, 9)]
    assert texts == [f"document number {i}" for i in (0, 1, 3, 4, 5, 6, 8, 10, 11)]
    assert documents.index.name(2) == f"--data {str(path)!r} line 4"  # names stay the file's lines


def test_a_bad_parquet_record_is_named_by_its_1_based_number(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), path, row_group_size=2)
    documents = records.LazyDocuments(str(path), None)
    assert len(documents) == 3 and documents.bad == [f"--data {str(path)!r} record 3: field 'text' holds NoneType, not text"]


def test_skip_bad_records_trains_on_without_them_and_says_how_many(tmp_path, capsys):
    path = documents_file(tmp_path / "docs.jsonl", 300, bad_lines=(5, 280))
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--steps", "2", "--batch-size", "8", "--seq-len", "16", "--data", str(path),
                 "--metrics", str(metrics), "--skip-bad-records"])
    captured = capsys.readouterr()
    err, out = " ".join(captured.err.split()), " ".join(captured.out.split())
    assert code == 0 and len(metrics.read_text().splitlines()) == 2, err
    assert (f"warning: --skip-bad-records: training without 2 bad records of --data {str(path)!r}; the first: "
            f"--data {str(path)!r} line 5 is not JSON") in err
    assert "2 bad records skipped (--skip-bad-records)" in out and "298 documents" in out


def test_a_token_id_outside_the_vocabulary_is_refused_at_start_up(tmp_path, capsys):
    tokens = np.full(100_000, 7, np.uint16)
    tokens[90_000] = 65000  # tiny's vocabulary is 256
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--data", str(path),
                 "--metrics", str(metrics)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and not metrics.exists() and "Traceback" not in err
    assert f"--data {str(path)!r} holds token ids outside the model's vocabulary [0, 256): 65000 (smallest 7, " \
           "largest 65000); the first is token 90,001 of 100,000 (1-based); re-tokenize" in err


def test_eval_refuses_a_bad_held_out_record_in_one_line_or_goes_without_it(tmp_path, capsys):
    clean, bad = documents_file(tmp_path / "clean.jsonl", 300), documents_file(tmp_path / "bad.jsonl", 300,
                                                                               bad_lines=(296,))
    directory = tmp_path / "ck"
    assert main(["train", "--steps", "1", "--batch-size", "8", "--seq-len", "16", "--data", str(clean),
                 "--checkpoint-dir", str(directory)]) == 0
    capsys.readouterr()
    evaluate = ["eval", "--checkpoint-dir", str(directory), "--data", str(bad), "--seq-len", "16"]
    assert main(evaluate) == 2  # refused as training refuses the source (line 296 lies in the held-out tail)
    err = " ".join(capsys.readouterr().err.split())
    assert err == (f"error: --data {str(bad)!r} line 296 is not JSON (Unterminated string starting at: column 10); "
                   "fix the data, or evaluate without the bad records: --skip-bad-records")
    assert main([*evaluate, "--skip-bad-records"]) == 0
    captured = capsys.readouterr()
    assert (f"warning: --skip-bad-records: evaluating without 1 bad record of --data {str(bad)!r}; the first: "
            f"--data {str(bad)!r} line 296 is not JSON") in " ".join(captured.err.split())
    assert json.loads(captured.out.strip().splitlines()[-1])["eval_tokens"] > 0
