"""Generation: the KV cache gives the tokens of full recomputation, token for token; sharded equals unsharded."""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.cli import main
from jaxpar.run.generate import Generator, generation_plan, left_pad, sample
from jaxpar.models.inference import init_cache
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.train.state import init_state

CFG = LlamaConfig(vocab=300, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=96)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [100]]


@pytest.fixture(scope="module")
def model_and_params():
    model, state = init_state(lambda: Llama(CFG, nnx.Rngs(0)), optax.sgd(0.1), generation_plan("data=1"))
    return model, jax.device_get(state.params)


TOP_P = {"temperature": 1.0, "top_p": 0.9}
_generated: dict = {}


def generate(model_and_params, mesh="data=1", use_cache=True, sampling=False):
    """New tokens for PROMPTS (memoised: each configuration compiles once per test session)."""
    key = (mesh, use_cache, sampling)
    if key not in _generated:
        model, params = model_and_params
        options = TOP_P if sampling else {}
        generator = Generator(model, CFG, params, generation_plan(mesh), max_new_tokens=10, use_cache=use_cache,
                              **options)
        _generated[key] = generator(PROMPTS, seed=3)[0]
    return _generated[key]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "top-p"])
def test_kv_cache_equals_recomputation(model_and_params, sampling):
    """Left-padded prompts of different lengths: the cache path equals re-running the whole sequence per token."""
    cached = generate(model_and_params, sampling=sampling)
    assert cached == generate(model_and_params, use_cache=False, sampling=sampling)
    assert len(cached) == 4 and all(len(row) == 10 for row in cached)


def test_sharded_equals_unsharded(model_and_params):
    assert generate(model_and_params, "data=2,tensor=2", sampling=True) == generate(model_and_params, sampling=True)


def test_cache_is_split_over_data_and_tensor():
    plan = generation_plan("data=2,tensor=2")
    with plan.activate():
        cache = jax.jit(lambda: init_cache(CFG, 4, 16))()
    assert cache["k"].sharding.spec == P(None, "data", None, "tensor")


def test_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    draws = {int(sample(logits, jax.random.key(i), 1.0, 0.7)[0]) for i in range(200)}
    assert draws == {0, 1}
    assert int(sample(logits, jax.random.key(0), 0.0, 1.0)[0]) == 0
    tokens, mask = left_pad([[5, 6], [7]], rows=3)
    assert tokens.tolist() == [[5, 6], [0, 7], [0, 7]] and mask.tolist() == [[True, True], [False, True], [False, True]]


def test_generate_and_eval_commands(tmp_path, capsys, model_and_params):
    """Both commands read a training checkpoint directory (here saved directly, without training)."""
    import dataclasses

    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.state import TrainState

    model, params = model_and_params
    config = {"model": {"name": "tiny", "config": dataclasses.asdict(CFG)}}
    with Checkpoints(tmp_path / "run", config=config) as checkpoints:
        checkpoints.save(3, TrainState(params, {}, np.int32(3)), force=True)
        checkpoints.wait()
    assert main(["generate", "--checkpoint-dir", str(tmp_path / "run"), "--prompt", "The ", "--prompt", "A",
                 "--max-new-tokens", "5", "--mesh", "data=2,tensor=2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["completions"]) == 2 and all(len(row) == 5 for row in result["tokens"])
    assert result["tokens_per_s"] > 0
    assert main(["eval", "--checkpoint-dir", str(tmp_path / "run"), "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["eval_tokens"] > 0 and np.isclose(report["eval_ppl"], np.exp(report["eval_loss"]))


def test_generate_stops_at_the_configs_eos_ids_and_shows_ids_past_the_bytes(tmp_path, capsys, model_and_params):
    """As transformers does, the config's `eos_token_id` (one or several) ends a sequence by default; without a
    tokenizer an id that is no byte is shown as `<id>`, never dropped."""
    import dataclasses

    from jaxpar.run.generate import text_codec
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.state import TrainState

    _, params = model_and_params

    def generated(hf_config):
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        model = {"name": "tiny", "config": dataclasses.asdict(CFG), "hf_config": hf_config}
        with Checkpoints(directory, config={"model": model}) as checkpoints:
            checkpoints.save(1, TrainState(params, {}, np.int32(1)), force=True)
        assert main(["generate", "--checkpoint-dir", str(directory), "--prompt", "The ", "--max-new-tokens", "6",
                     "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    free = generated({})
    row = free["tokens"][0]
    assert free["eos"] is None and len(set(row[:3])) == 3, row  # three distinct tokens to stop at the third
    stopped = generated({"eos_token_id": [299 if row[2] != 299 else 298, row[2]]})
    assert stopped["tokens"][0] == row[:3] + [stopped["eos"][0]] * 3
    _, decode = text_codec(None, CFG.vocab)
    assert stopped["completions"][0] == decode(row[:2])
    assert decode([72, 105, 299, 0xC3, 0xA9, 256]) == "Hi<299>\u00e9<256>"


@pytest.mark.parametrize("command", ["train", "import-hf", "eval", "generate", "export", "tokenize"])
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0 and "--" in capsys.readouterr().out


def test_tokenize_with_a_tokenizer_json(tmp_path, capsys):
    """`jaxpar tokenize` writes .npy tokens that --data reads, and a header naming dtype, vocabulary and tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from jaxpar.data.tokens import load_tokens

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("hello world hello there")
    assert main(["tokenize", str(tmp_path / "text.txt"), "--out", str(tmp_path / "t.npy"),
                 "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
    header = json.loads((tmp_path / "t.json").read_text())
    assert (header["dtype"], header["vocab"], header["tokens"]) == ("uint8", 3, 4) and header["tokenizer_sha256"]
    assert load_tokens(tmp_path / "t.npy").tolist() == [1, 2, 1, 0]
    assert main(["tokenize", str(tmp_path / "text.txt"), "--out", str(tmp_path / "b.npy")]) == 0
    assert load_tokens(tmp_path / "b.npy").tobytes() == b"hello world hello there"
