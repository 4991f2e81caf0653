"""LoRA: adapters start the model at its base, train like a plain-JAX LoRA on every strategy, and sum only themselves."""

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import reference_lora
from helpers import TINY, batches, copy_state, max_relative_error, sharded_lookup_bytes, single_device_plan
from jaxpar.core.plan import Plan
from jaxpar.models.llama import Llama
from jaxpar.models.moe import MoeLlama, MoeLlamaConfig
from jaxpar.parallel import lora
from jaxpar.pipeline.layer_order import to_natural_order
from jaxpar.planner import inspect
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

RANK, ALPHA, STEPS = 4, 8.0, 2
ALL = ("q", "k", "v", "o", "gate", "up", "down")
OPTIMIZER = optax.sgd(0.5, momentum=0.9)  # linear in the gradients: Adam's first step from B = 0 is sign(g), noise on near-zero entries
DATA = batches(batch_size=8, seq_len=16)
MIXTRAL = MoeLlamaConfig(vocab=256, d_model=32, n_layers=2, moe_every=1, n_heads=2, n_kv_heads=2, head_dim=16,
                         d_ff=64, expert_d_ff=32, n_experts=4, top_k=2, dropless=True, seq_len=16)
# a Qwen3-MoE's dense first layer (mlp_only_layers=[0]): a prefix stack of its own, adapted like the others
QWEN3_MOE_PREFIX = dataclasses.replace(MIXTRAL, n_layers=3, first_dense=1, qk_norm=True)
CONFIGS = {"llama": (Llama, TINY), "mixtral": (MoeLlama, MIXTRAL), "qwen3-moe-prefix": (MoeLlama, QWEN3_MOE_PREFIX)}


def build(family: str, adapters: bool = True, targets=ALL, dropout: float = 0.0):
    make, cfg = CONFIGS[family]
    model = make(cfg, nnx.Rngs(0))
    if adapters:
        lora.apply(model, RANK, ALPHA, targets=targets, rngs=nnx.Rngs(1), dropout=dropout)
    return model


@functools.cache
def initial(family: str, targets=ALL, dropout: float = 0.0):
    """The model and its step-0 state, every B drawn small and random (B = 0 gives A no gradient at first)."""
    model, state = init_state(lambda: build(family, targets=targets, dropout=dropout), OPTIMIZER, single_device_plan(),
                              trainable=lora.TRAINABLE)
    return model, reference_lora.with_random_b(copy_state(state))


@functools.cache
def run(family: str, mesh: str, targets=ALL, **options):
    """(losses, final parameters, compiled step, plan) of STEPS LoRA steps on `mesh`."""
    model, state = initial(family, targets, options.get("lora_dropout", 0.0))
    plan = Plan.create(mesh, **options)
    state = place_state(copy_state(state), model, OPTIMIZER, plan)
    compiled = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan).lower(state, DATA[0]).compile()
    losses = []
    for i in range(STEPS):
        state, metrics = compiled(state, DATA[i])
        losses.append(float(metrics["loss"]))
    state = jax.device_get(state)
    state.params = to_natural_order(state.params, model.logical, plan)  # an interleaved plan holds its chunks' order
    return np.array(losses), state, compiled, plan


@functools.cache
def expected(family: str, targets=ALL):
    _, state = initial(family, targets)
    return reference_lora.train(CONFIGS[family][1], state.params, [DATA[i] for i in range(STEPS)], OPTIMIZER,
                                ALPHA / RANK)


def test_zero_b_gives_the_base_models_logits_bitwise():
    with nnx.use_eager_sharding(False):
        base, adapted = build("llama", adapters=False), build("llama")
    tokens = np.asarray(DATA[0]["inputs"])
    assert np.abs(np.asarray(adapted.blocks.wq_lora_a[...])).max() > 0  # A random, B zero
    logits = nnx.jit(lambda m, t: m.logits(t))
    assert np.array_equal(np.asarray(logits(lora.merged(adapted), tokens)), np.asarray(logits(base, tokens)))
    loss = nnx.jit(lambda m, b: m(b)[0])  # the training forward, adapters folded per layer in the scan
    assert np.asarray(loss(adapted, DATA[0])) == np.asarray(loss(base, DATA[0]))


MESHES = [
    ("llama", "data=8", {}),
    ("llama", "data=8", {"zero": 3}),
    ("llama", "data=2,tensor=4", {}),
    ("llama", "data=2,tensor=4", {"tensor_form": "explicit"}),
    ("llama", "data=2,tensor=2,pipe=2", {"schedule": "1f1b", "microbatches": 2}),
    ("llama", "data=2,context=4", {}),
    ("mixtral", "data=4,expert=2", {}),
    ("qwen3-moe-prefix", "data=4,expert=2", {"zero": 3}),
    *(pytest.param(*cell, marks=pytest.mark.slow) for cell in [
        ("llama", "data=8", {"zero": 1}),
        ("llama", "data=8", {"zero": 2}),
        ("llama", "replica=2,data=4", {"zero": 3}),
        ("llama", "data=2,tensor=4", {"sequence_parallel": True}),
        ("llama", "data=2,pipe=4", {"schedule": "gpipe", "microbatches": 4}),
        ("llama", "data=4,pipe=2", {"schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}),
        ("llama", "data=4,pipe=2", {"schedule": "zb-h1", "microbatches": 2}),
        ("llama", "data=2,context=4", {"context_form": "ring"}),
        ("mixtral", "data=2,expert=2,tensor=2", {"zero": 3}),
    ]),
]


@pytest.mark.parametrize("family,mesh,options", MESHES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={o}" for k, o in v.items()) or "-")
def test_lora_training_matches_plain_jax_reference(family, mesh, options):
    losses, final, _, plan = run(family, mesh, **options)
    ref = expected(family)
    adapters, frozen = reference_lora.split(final.params)
    adapters0, start = reference_lora.split(initial(family)[1].params)
    moved = lambda tree: jax.tree.map(lambda x, x0: np.asarray(x) - x0, tree, adapters0)  # noqa: E731
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5
    assert max_relative_error(adapters, ref.params) <= 1e-5
    assert max_relative_error(moved(adapters), moved(ref.params)) <= 1e-5  # the updates: A moves little against its size
    assert max_relative_error(frozen, start) == 0.0  # the base never moves
    assert ref.losses[-1] < ref.losses[0]
    if CONFIGS[family][1] is QWEN3_MOE_PREFIX:  # the dense prefix's own adapters, on its own axis, trained too
        assert {"wq_lora_a", "w_gate_lora_a"} <= set(adapters["blocks"]["prefix"])


def test_frozen_weights_beside_adapted_ones_in_fused_matmuls_train_on_data_pipe_and_tensor():
    """q and v adapted, k (fused with them) and gate/up (fused together) frozen, on data x pipe x tensor: the
    pipeline's residual ring hands the frozen weights back varying over data like the adapted ones."""
    targets = ("q", "v")
    losses, final, _, _ = run("llama", "data=2,tensor=2,pipe=2", targets, schedule="1f1b", microbatches=2)
    ref = expected("llama", targets)
    adapters, frozen = reference_lora.split(final.params)
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5
    assert max_relative_error(adapters, ref.params) <= 1e-5
    assert max_relative_error(frozen, reference_lora.split(initial("llama", targets)[1].params)[1]) == 0.0
    assert sorted({key.split("_lora")[0] for key in adapters["blocks"]}) == ["wq", "wv"]


def adapter_bytes(params) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(reference_lora.split(params)[0]))


def test_data_parallel_all_reduce_moves_exactly_the_adapters():
    losses, final, compiled, plan = run("llama", "data=8")
    sums = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "all-reduce"]
    scalars = 4  # the loss's mean over data rides in the same all-reduce
    assert len(sums) == 1 and sums[0].axes == ("data",)
    assert (sums[0].bytes - scalars) / adapter_bytes(final.params) == 1.0
    assert len(inspect.collectives(compiled, plan.mesh)) == 1  # no base weight is summed, nor anything else
    momentum = jax.tree.leaves(final.opt_state)
    assert sum(a.nbytes for a in momentum) == adapter_bytes(final.params)  # the optimizer state: the adapters' alone


@pytest.mark.parametrize("targets,rank,message", [
    (("q", "wqkv"), RANK, "--lora-targets 'wqkv' names no weight of the model"),
    (("q",), 65, "--lora-rank 65 is larger than blocks/wq's input dimension (64)"),
])
def test_bad_targets_and_ranks_are_refused_in_one_line(targets, rank, message):
    with nnx.use_eager_sharding(False):
        model = build("llama", adapters=False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        lora.apply(model, rank, targets=targets)
    assert "\n" not in str(error.value)


def test_a_lora_table_is_the_plans_lora_options(tmp_path):
    from jaxpar.cli import build_parser, resolve

    config = tmp_path / "run.toml"
    config.write_text('[lora]\nrank = 4\nalpha = 8\ntargets = ["q", "v", "down"]\n')
    _, options, _ = resolve(build_parser().parse_args(["train", "--config", str(config), "--mesh", "data=8"]))
    assert options == {"lora_rank": 4, "lora_alpha": 8, "lora_targets": ["q", "v", "down"]}
    assert Plan.create("data=8", **options).lora_targets == ("q", "v", "down")
    config.write_text('[plan]\nlora_rank = 4\n[lora]\nrank = 8\n')
    with pytest.raises(ValueError, match=r"\[lora\] rank and \[plan\] lora_rank both set it"):
        resolve(build_parser().parse_args(["train", "--config", str(config)]))


@pytest.mark.slow
def test_cli_trains_only_the_adapters_from_a_lora_table(tmp_path):
    """A [lora] table is the plan's lora_* options: the run trains the adapters, and its loss starts at the base's."""
    from jaxpar.cli import main

    config = tmp_path / "run.toml"
    config.write_text('[mesh]\ndata = 8\n[lora]\nrank = 4\nalpha = 8.0\ntargets = ["q", "v", "down"]\n')
    rows = {}
    for name, flags in (("lora", ["--config", str(config)]), ("base", ["--mesh", "data=8"])):
        metrics = tmp_path / f"{name}.jsonl"
        assert main(["train", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--lr", "1e-2",
                     "--metrics", str(metrics), *flags]) == 0
        rows[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows["lora"][0]["loss"] == rows["base"][0]["loss"]  # B = 0: the first step's loss is the base model's
    assert rows["lora"][2]["loss"] != rows["base"][2]["loss"]  # step 1's learning rate is 0 (warm-up)


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "4", "--lora-targets", "q,wqkv"], "--lora-targets 'wqkv' names no weight of the model"),
    (["--lora-rank", "65"], "--lora-rank 65 is larger than blocks/wq's input dimension (64)"),
    (["--lora-rank", "4", "--lora-dropout", "1.5"], "lora_dropout must be in [0, 1), got 1.5"),
    (["--lora-targets", "q"], "lora_targets are set but lora_rank is 0"),
])
def test_cli_refuses_bad_lora_options_before_compiling(flags, message, capsys):
    from jaxpar.cli import main

    assert main(["train", "--steps", "1", "--mesh", "data=8", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


class UserMLP(nnx.Module):
    """A user's own Flax model, built from nnx.Linear as Flax's tutorials write it (no layer stack)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class UserStack(nnx.Module):
    """The same block three times in a `jaxpar.Stack` (parameters stacked on `layers`, scanned)."""

    def __init__(self, rngs: nnx.Rngs):
        import jaxpar

        self.blocks = jaxpar.Stack(lambda r: UserMLP(r), 3, rngs=rngs)

    def __call__(self, x):
        return self.blocks(x)


def user_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def reference_forward(kind: str, params, x):
    """The user's model on plain parameters, its stacked layers walked in a Python loop."""
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(UserMLP(nnx.Rngs(0)))
    if kind == "mlp":
        return nnx.merge(graphdef, params)(x)
    for i in range(3):
        x = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], params["blocks"]["layers"]))(x)
    return x


@pytest.mark.parametrize("kind", ["mlp", "stack"])
@pytest.mark.parametrize("mesh,options", [("data=8", {}), ("data=8", {"zero": 3}), ("data=2,tensor=4", {})])
def test_a_users_own_flax_model_trains_its_adapters_only(mesh, options, kind):
    """`jaxpar.lora.apply` on nnx.Linear kernels by path pattern, in a plain module or a `jaxpar.Stack`; the step
    matches plain JAX + optax on W + (alpha / r) A B, differentiated by the adapters alone."""
    import jaxpar

    def make():
        model = (UserMLP if kind == "mlp" else UserStack)(nnx.Rngs(0))
        trainable = jaxpar.lora.apply(model, 2, 4.0, targets=("*/kernel",), rngs=nnx.Rngs(1))
        assert trainable is nnx.LoRAParam
        return model

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(STEPS)]
    data = [{"x": x, "y": np.zeros_like(x)} for x in xs]
    model, state0 = init_state(make, OPTIMIZER, single_device_plan(), trainable=jaxpar.lora.TRAINABLE)
    state0 = copy_state(state0)
    up = state0.params["up"] if kind == "mlp" else state0.params["blocks"]["layers"]["up"]
    up["kernel_lora_b"] = (0.1 * rng.standard_normal(up["kernel_lora_b"].shape)).astype(np.float32)
    plan = Plan.create(mesh, **options)
    state = place_state(copy_state(state0), model, OPTIMIZER, plan)
    step = make_train_step(model, user_loss, OPTIMIZER, plan)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))

    adapters, frozen = reference_lora.split(state0.params)

    def loss(a, batch):
        out = reference_forward(kind, reference_lora.effective(frozen, a, 2.0), batch["x"])
        return ((out - batch["y"]) ** 2).mean(), {}

    ref = reference_lora.reference.train(loss, adapters, data, OPTIMIZER)
    final_adapters, final_frozen = reference_lora.split(jax.device_get(state.params))
    assert np.max(np.abs(np.array(losses) / ref.losses - 1)) <= 1e-5
    assert max_relative_error(final_adapters, ref.params) <= 1e-5
    assert max_relative_error(final_frozen, frozen) == 0.0
    assert ref.losses[-1] < ref.losses[0]


def test_held_out_evaluation_reads_the_adapters():
    """--eval-every's forward (the logits path, not the training loss) sees W + (alpha / r) A B."""
    from jaxpar.run.evaluate import Evaluator

    model, state = initial("llama")  # B random: the adapted model is not its base
    inputs, targets = np.asarray(DATA[0]["inputs"]), np.asarray(DATA[0]["targets"])
    windows = {"inputs": inputs, "targets": targets, "weights": np.ones(inputs.shape, np.float32)}
    figures = Evaluator(model, single_device_plan(), windows, 8)(state.params)
    adapters, frozen = reference_lora.split(state.params)
    effective = reference_lora.effective(jax.tree.map(np.asarray, frozen), adapters, ALPHA / RANK)
    expected_loss = float(reference_lora.reference.llama_loss(effective, DATA[0], TINY)[0])
    base_loss = float(reference_lora.reference.llama_loss(reference_lora.effective(frozen, {}, 0.0), DATA[0], TINY)[0])
    assert abs(figures["eval_loss"] / expected_loss - 1) <= 1e-5
    assert abs(base_loss / expected_loss - 1) > 1e-3


def test_adapters_join_weights_read_from_elsewhere():
    """--init-from with --lora-rank: the weights read are the frozen base, the adapters start as `apply` makes them."""
    from jaxpar.train.state import describe, state_from_base

    plan = Plan.create("data=8")
    _, base = init_state(lambda: build("llama", adapters=False), OPTIMIZER, single_device_plan())
    base = jax.tree.map(lambda x: np.asarray(x) + 1.0, base.params)  # weights no init of this model gives
    model = describe(lambda: build("llama"), lora.TRAINABLE)
    state = jax.device_get(state_from_base(base, lambda: build("llama"), model, OPTIMIZER, plan))
    adapters, frozen = reference_lora.split(state.params)
    made = jax.device_get(init_state(lambda: build("llama"), OPTIMIZER, plan, trainable=lora.TRAINABLE)[1].params)
    fresh, _ = reference_lora.split(made)
    assert max_relative_error(reference_lora.effective(frozen, {}, 0.0), base) == 0.0  # every weight read, unchanged
    assert max_relative_error(adapters, fresh) == 0.0
    assert sum(a.nbytes for a in jax.tree.leaves(state.opt_state)) == adapter_bytes(made)


def test_zero3_reduce_scatters_only_the_adapters_and_gathers_the_base_for_forward_and_backward():
    _, final, compiled, plan = run("llama", "data=8", zero=3)
    rows = {row["kind"]: row for row in inspect.collectives(compiled, plan.mesh)}
    lookup = sharded_lookup_bytes(dataclasses.replace(TINY, seq_len=DATA.seq_len), DATA.batch_size)["rows"]
    assert lookup > 0  # the frozen table's lookup: its rows reduce-scattered forward (no gradient comes back)
    assert rows["reduce-scatter"]["bytes"] == adapter_bytes(final.params) + lookup
    frozen_layers = sum(a.nbytes for k, a in reference_lora.split(final.params)[1]["blocks"].items()
                        if not k.endswith("_lora_scale"))
    assert rows["all-gather"]["bytes"] >= 2 * frozen_layers  # each layer's base gathered for the forward and again


def test_eval_and_generate_read_a_lora_checkpoint_with_its_adapters_folded(tmp_path, capsys):
    """`jaxpar eval` / `generate` on a LoRA run's checkpoint: the adapters are read and folded into their weights
    (they were refused as 'not in the model'); eval gives the run's own held-out loss at that step."""
    from jaxpar.cli import main

    directory, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert main(["train", "--mesh", "data=8", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--lr", "1e-2",
                 "--lora-rank", "4", "--lora-targets", "q,v,down", "--eval-every", "3", "--checkpoint-dir", str(directory),
                 "--metrics", str(metrics)]) == 0
    in_run = [json.loads(line) for line in metrics.read_text().splitlines() if "eval_loss" in line][-1]
    capsys.readouterr()
    assert main(["eval", "--checkpoint-dir", str(directory), "--seq-len", "16"]) == 0
    from_checkpoint = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(from_checkpoint["eval_loss"] / in_run["eval_loss"] - 1) <= 1e-5, (from_checkpoint, in_run)
    assert main(["generate", "--checkpoint-dir", str(directory), "--prompt", "The ", "--max-new-tokens", "4"]) == 0


def test_bf16_holds_the_frozen_base_in_bf16_and_computes_what_an_fp32_base_gave():
    """--precision bf16: the frozen base is held in bf16 (the cast the step made at use anyway), the adapters and
    their scales in fp32. The loss and the adapters' gradients equal those of the same state with an fp32 base
    bitwise, and training tracks the fp32 reference within the bf16 tests' 5% (tests/test_precision.py)."""
    from jaxpar.train.step import loss_and_grads

    model, start = initial("llama")
    losses, final, compiled, plan = run("llama", "data=8", precision="bf16")
    adapters, frozen = reference_lora.split(final.params)
    scales = {k for k in frozen["blocks"] if k.endswith("_lora_scale")}
    assert {a.dtype for a in jax.tree.leaves(adapters)} == {np.dtype(np.float32)}
    assert {frozen["blocks"][k].dtype for k in scales} == {np.dtype(np.float32)}
    base = [a for k, a in frozen["blocks"].items() if k not in scales] + [frozen["embedding"], frozen["head"]]
    assert {a.dtype for a in base} == {jax.numpy.dtype("bfloat16")}
    fp32_base = sum(a.size for a in jax.tree.leaves(reference_lora.split(start.params)[1])) * 4
    held = sum(a.nbytes for a in jax.tree.leaves(frozen))
    arguments = compiled.memory_analysis().argument_size_in_bytes
    print(f"bf16 LoRA: frozen base {held} bytes (fp32 {fp32_base}), compiled step arguments {arguments} per device")
    assert held < 0.51 * fp32_base and arguments < held + 3 * adapter_bytes(final.params) + 4096
    assert np.max(np.abs(losses / expected("llama").losses - 1)) <= 0.05
    assert max_relative_error(frozen, reference_lora.split(start.params)[1]) <= 2 ** -8  # rounded once, never moved

    one = single_device_plan(precision="bf16")
    held_state = place_state(copy_state(start), model, OPTIMIZER, one)
    with one.activate():
        grads = jax.jit(lambda p: loss_and_grads(model, lambda m, b: m(b), p, DATA[0], one)[::2])
        (loss32, g32), (loss16, g16) = grads(start.params), grads(held_state.params)
    assert next(iter(jax.tree.leaves(held_state.params["blocks"]["wq"]))).dtype == jax.numpy.bfloat16
    assert float(loss32) == float(loss16)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), g32, g16))


DROPOUT = 0.1
DROPOUT_MESHES = [
    ("data=8", {}),
    ("data=2,tensor=4", {}),
    pytest.param("data=8", {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("data=2,tensor=2,pipe=2", {"schedule": "1f1b", "microbatches": 2}, marks=pytest.mark.slow),
    pytest.param("data=2,pipe=4", {"schedule": "gpipe", "microbatches": 4}, marks=pytest.mark.slow),  # int salts' float0
    pytest.param("data=4,tensor=2", {"grad_accum": 2, "sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param("tensor=8", {}, marks=pytest.mark.slow),  # 4 kv heads on 8 ranks: B's heads repeat like W's
]


@functools.cache
def expected_with_dropout():
    _, state = initial("llama", ALL, DROPOUT)
    return reference_lora.train_with_dropout(TINY, state.params, [DATA[i] for i in range(STEPS)], OPTIMIZER,
                                             ALPHA / RANK, DROPOUT)


@pytest.mark.parametrize("mesh,options", DROPOUT_MESHES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={o}" for k, o in v.items()) or "-")
def test_lora_dropout_trains_like_a_plain_jax_reference_drawing_the_documented_mask(mesh, options):
    """PEFT's x W + (alpha / r) dropout(x) A B on every adapter's input, p = 0.1, the mask drawn from the step's
    global per-token seeds and each layer's salt (jaxpar.parallel.lora_dropout): every plan equals one device."""
    losses, final, _, _ = run("llama", mesh, lora_dropout=DROPOUT, **options)
    ref = expected_with_dropout()
    adapters, frozen = reference_lora.split(final.params)
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5
    assert max_relative_error(adapters, ref.params) <= 1e-5
    assert abs(ref.losses[0] / expected("llama").losses[0] - 1) > 1e-3  # the mask acts: not the run without dropout


def test_lora_dropout_is_off_outside_training():
    """Evaluation, the logits (generate, export) and a forward outside the step fold the adapters: p = 0.1 gives
    p = 0's figures exactly (the same adapters: the salts draw no key)."""
    from jaxpar.run.evaluate import Evaluator

    (model, state), (_, plain) = initial("llama", ALL, DROPOUT), initial("llama")
    assert lora.has_salts(state.params) and not lora.has_salts(plain.params)
    inputs, targets = np.asarray(DATA[0]["inputs"]), np.asarray(DATA[0]["targets"])
    windows = {"inputs": inputs, "targets": targets, "weights": np.ones(inputs.shape, np.float32)}
    plan = single_device_plan(lora_dropout=DROPOUT)
    with_dropout = Evaluator(model, plan, windows, 8)(state.params)
    without = Evaluator(initial("llama")[0], single_device_plan(), windows, 8)(plain.params)
    assert with_dropout["eval_loss"] == without["eval_loss"]
    logits = {}
    for name, (m, s) in {"dropout": initial("llama", ALL, DROPOUT), "plain": initial("llama")}.items():
        with plan.activate():
            module = m.merge(jax.tree.map(jax.numpy.asarray, s.params))
            logits[name] = (np.asarray(nnx.jit(lambda x, t: lora.merged(x).logits(t))(module, inputs)),
                            float(nnx.jit(lambda x, b: x(b)[0])(module, DATA[0])))
    assert np.array_equal(logits["dropout"][0], logits["plain"][0]) and logits["dropout"][1] == logits["plain"][1]


@pytest.mark.parametrize("options,message", [
    ({"lora_dropout": 1.0}, "lora_dropout must be in [0, 1), got 1.0"),
    ({"lora_dropout": 0.1, "tensor_form": "explicit"}, "lora_dropout=0.1 runs its branch in the annotation form"),
    ({"lora_dropout": 0.1, "_mesh": "data=2,context=4"}, "lora_dropout=0.1 is not supported with context parallelism"),
])
def test_lora_dropout_that_cannot_act_is_refused_in_one_line(options, message):
    options = dict(options)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as error:
        Plan.create(options.pop("_mesh", "data=2,tensor=4"), **options)
    assert "\n" not in str(error.value)


def test_lora_dropout_on_expert_weights_or_without_salts_is_refused_by_name():
    with nnx.use_eager_sharding(False), pytest.raises(ValueError, match="--lora-dropout 0.1 acts on the weights of a "
                                                                         "layer stack, not on .*expert_gate"):
        lora.apply(MoeLlama(MIXTRAL, nnx.Rngs(0)), RANK, targets=("gate",), dropout=DROPOUT)
    model, state = initial("llama")
    with pytest.raises(ValueError, match="the plan sets lora_dropout=0.1 but the model's adapters have no dropout"):
        make_train_step(model, lambda m, b: m(b), OPTIMIZER, Plan.create("data=8", lora_dropout=DROPOUT))
