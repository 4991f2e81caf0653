"""The README's own-model example runs exactly as written, and shards what it says it shards."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_trains_a_user_model(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "class MLP" in b]
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "up kernel sharding: P(None, 'tensor')" in out
    assert float(namespace["metrics"]["loss"]) < 0.5 * float(_initial_loss(namespace))


def _initial_loss(ns):
    from flax import nnx

    with nnx.use_eager_sharding(False):
        model = ns["MLP"](nnx.Rngs(0))
    return ns["loss_fn"](model, ns["batch"])[0]


def test_readme_stack_example_trains_under_zero3():
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "class MLP" in b]
    (stacked,) = [b for b in blocks if "jaxpar.Stack(" in b]
    namespace: dict = {}
    exec(compile(example + stacked, str(README), "exec"), namespace)
    plan = jaxpar.Plan.create("data=8", zero=3)
    model, state = jaxpar.init_state(lambda: namespace["Model"](nnx.Rngs(0)), optax.adamw(1e-2), plan)
    assert model.logical["blocks"]["layers"]["up"]["kernel"].names == ("layers", "embed", "mlp")
    step = jaxpar.make_train_step(model, namespace["loss_fn"], optax.adamw(1e-2), plan)
    losses = []
    for _ in range(6):
        state, metrics = step(state, namespace["batch"])
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
