"""The model of Flax's guide "Scale up on multiple devices" (DotReluDot, MultiDotReluDot) on jaxpar.

Three changes against the guide: the activation constraint names logical axes
(`jaxpar.constrain`, since the step runs the model once per data rank), and
the sublayers are a `jaxpar.Stack` instead of `nnx.vmap` + `jax.lax.scan`, so
ZeRO-3 gathers them one layer at a time. The guide's mesh axis `model` stays a
name in the annotations: the plan maps it onto jaxpar's `tensor` (RULES).

    python examples/flax_guide_mlp.py --mesh data=4,tensor=2 [--zero 3]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar

RULES = {"model": "tensor"}  # the guide's `model` axis, as a logical name
DEPTH, LAYERS, BATCH = 64, 2, 16  # the guide: 1024, 2, 8


class DotReluDot(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(
      depth, depth,
      kernel_init=nnx.with_partitioning(init_fn, (None, 'model')),
      use_bias=False,  # or use `bias_init` to give it annotation too
      rngs=rngs)
    self.w2 = nnx.Param(
      init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2 creation
      out_sharding=('model', None),
    )

  def __call__(self, x: jax.Array):
    y = self.dot1(x)
    y = jax.nn.relu(y)
    y = jaxpar.constrain(y, ('batch', 'model'))
    z = jnp.dot(y, self.w2[...])
    return z

class MultiDotReluDot(nnx.Module):
  def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
    self.layers = jaxpar.Stack(lambda r: DotReluDot(depth, r), num_layers, rngs=rngs)

  def __call__(self, x):
    return self.layers(x)


def make_model():
    return MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))


def make_optimizer():
    return optax.adam(1e-3)


def loss_fn(model, batch):
    return jnp.mean((model(batch["input"]) - batch["label"]) ** 2)


def batches(steps: int):
    """Synthetic regression batches, as the guide trains on random inputs and labels."""
    rng = np.random.default_rng(0)
    return [{"input": rng.normal(size=(BATCH, DEPTH)).astype(np.float32),
             "label": rng.normal(size=(BATCH, DEPTH)).astype(np.float32)} for _ in range(steps)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=4,tensor=2")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    plan = jaxpar.Plan.create(args.mesh, zero=args.zero, rules=RULES)
    model, state = jaxpar.init_state(make_model, make_optimizer(), plan)
    step = jaxpar.make_train_step(model, loss_fn, make_optimizer(), plan)
    for i, batch in enumerate(batches(args.steps)):
        state, metrics = step(state, batch)
        print(f"step {i}: loss {float(metrics['loss']):.6f}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 CPU devices where there is no accelerator, as the guide does
    main()
