"""The CNN of Flax's MNIST tutorial (Conv, BatchNorm, Dropout, avg_pool, Linear) on jaxpar, on synthetic images.

The model and `loss_fn` are the tutorial's, `rngs` argument included: jaxpar
passes a loss_fn that takes `rngs` an `nnx.Rngs(fold_in(key(seed), step))`,
and the step writes the BatchNorm statistics back into `state.variables`. A
model with such state runs on the global batch (statistics of the whole
batch, the same dropout masks on any mesh). One change: `conv2` has no bias.
The BatchNorm right after it cancels the bias, so its gradient is round-off
that Adam would blow up into full-size steps, different on every mesh.

    python examples/cnn_batchnorm.py --mesh data=4,tensor=2 [--zero 3]
"""

import argparse
from functools import partial

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar

BATCH = 16  # the tutorial: 32


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits


learning_rate = 0.005
momentum = 0.9


def make_model():
    return CNN(rngs=nnx.Rngs(0))


def make_optimizer():
    return optax.adamw(learning_rate, momentum)


def batches(steps: int):
    """Synthetic MNIST-shaped batches: dark images with a bright 6x6 blob whose place (one of ten) is the label."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        label = rng.integers(0, 10, BATCH).astype(np.int32)
        image = (0.1 * rng.uniform(size=(BATCH, 28, 28, 1))).astype(np.float32)
        for i, k in enumerate(label):
            row, col = 4 + 12 * (k // 5), 2 + 5 * (k % 5)
            image[i, row:row + 6, col:col + 6] += 0.9
        out.append({"image": image, "label": label})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=4,tensor=2")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    plan = jaxpar.Plan.create(args.mesh, zero=args.zero)
    model, state = jaxpar.init_state(make_model, make_optimizer(), plan)
    step = jaxpar.make_train_step(model, loss_fn, make_optimizer(), plan)
    for i, batch in enumerate(batches(args.steps)):
        state, metrics = step(state, batch)
        accuracy = float(np.mean(np.argmax(metrics["aux"], -1) == batch["label"]))
        print(f"step {i}: loss {float(metrics['loss']):.6f}, accuracy {accuracy:.2f}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 CPU devices where there is no accelerator
    main()
