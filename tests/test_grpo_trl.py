"""GRPO's loss equals TRL's `GRPOTrainer._compute_loss` for fixed completions, rewards and old log-probs.

A tiny random Llama in transformers, imported into jaxpar. TRL scores the completions with the torch model
(its `selective_log_softmax` at the sampling temperature) and runs its own `_compute_loss` on them; jaxpar scores
them with the imported model and `jaxpar.objectives.grpo`. Old and reference log-probs are the torch scores moved
by noise, so the ratio clips on both sides and the KL is not small. Each normalization, beta 0 and not, a
completion cut at the length limit kept (TRL's default) and masked (mask_truncated_completions).
"""

import collections
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.interop import hf
from jaxpar.models.llama import Llama
from jaxpar.objectives import grpo

try:
    import torch
    import transformers
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import nanstd, selective_log_softmax
except ImportError:
    torch = None
pytestmark = pytest.mark.skipif(torch is None, reason="needs torch, transformers and trl (Python 3.11)")

STOP, PAD, TEMPERATURE, G = 2, 0, 0.7, 3
PROMPTS = np.array([[5, 17, 40, 9], [77, 3, 12, 101]], np.int64)
COMPLETIONS = np.array([  # a row without STOP was cut at the length limit; PAD follows a stop
    [30, 31, STOP, PAD, PAD, PAD, PAD],
    [44, 45, 46, 47, 48, 49, 50],
    [60, STOP, PAD, PAD, PAD, PAD, PAD],
    [70, 71, 72, 73, STOP, PAD, PAD],
    [STOP, PAD, PAD, PAD, PAD, PAD, PAD],
    [80, 81, 82, 83, 84, 85, STOP],
], np.int64)
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 0.0, 1.0], np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the transformers model, the same weights as jaxpar's Llama)."""
    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, max_position_embeddings=64)
    reference = transformers.LlamaForCausalLM(config).float().eval()
    reference.save_pretrained(directory)
    cfg, params = hf.load_hf_params(directory)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, params)
    return reference, nnx.merge(graphdef, state)


def trl_mask(completion_ids, mask_truncated):
    """TRL 1.16's completion mask (`_generate_and_score_completions`, written out: it is inline there)."""
    is_eos = torch.isin(completion_ids, torch.tensor([STOP]))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    mask = (torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)).int()
    if mask_truncated:
        truncated = torch.tensor([ids[-1] not in (STOP, PAD) for ids in completion_ids.tolist()])
        mask = mask * (~truncated).unsqueeze(1).int()
    return mask


def trl_advantages(rewards):
    """TRL 1.16's group-scaled advantages (scale_rewards='group', one reward function)."""
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    std = nanstd(grouped, dim=1).repeat_interleave(G)
    return (rewards - mean) / (std + 1e-4)


def trl_loss(model, inputs, loss_type, beta, logps):
    """TRL's `_compute_loss` on a stand-in trainer: its own code from the per-token log-probs on."""
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction: x)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    trainer = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=args, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, model=model,
        current_gradient_accumulation_steps=1, accelerator=accelerator, max_completion_length=COMPLETIONS.shape[1],
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": collections.defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    model.train()
    loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, model, inputs)
    return float(loss.detach()), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["cut-kept", "cut-masked"])
def test_loss_equals_trl(models, mask_truncated):
    reference, model = models
    prompts = np.repeat(PROMPTS, G, axis=0)
    completions = torch.tensor(COMPLETIONS)
    mask = grpo.completion_mask(COMPLETIONS, [STOP], mask_truncated)
    np.testing.assert_array_equal(mask, trl_mask(completions, mask_truncated).numpy())
    advantages, _ = grpo.group_advantages(REWARDS, G)
    trl_adv = trl_advantages(torch.tensor(REWARDS))
    np.testing.assert_allclose(advantages, trl_adv.numpy(), rtol=1e-6)

    tokens = np.concatenate([prompts, COMPLETIONS], axis=1)
    attention = np.concatenate([np.ones_like(prompts), mask], axis=1)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(attention)).logits
    P = prompts.shape[1]
    torch_logps = selective_log_softmax(logits[:, P - 1:-1] / TEMPERATURE, completions)
    generator = torch.Generator().manual_seed(1)
    old = torch_logps + 0.3 * torch.randn(torch_logps.shape, generator=generator)
    ref = torch_logps + 0.5 * torch.randn(torch_logps.shape, generator=generator)
    ours_logits = model.logits(jnp.asarray(tokens), mask=jnp.asarray(attention, bool))
    ours_logps = grpo.token_logps(ours_logits[:, P - 1:-1], jnp.asarray(COMPLETIONS), TEMPERATURE)
    real = mask.astype(bool)
    assert np.max(np.abs(np.asarray(ours_logps) - torch_logps.numpy())[real]) < 1e-5

    inputs = {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones_like(torch.tensor(prompts)),
              "completion_ids": completions, "completion_mask": torch.tensor(mask), "advantages": trl_adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(float(mask.sum()))}
    errors = {}
    for loss_type in grpo.LOSS_TYPES:
        for beta in (0.0, 0.04):
            expected, figures = trl_loss(reference, inputs, loss_type, beta, torch_logps.clone().requires_grad_())
            loss, ours = grpo.grpo_loss(ours_logps, jnp.asarray(old.numpy()), advantages, mask,
                                        jnp.asarray(ref.numpy()), beta, 0.2, 0.28, loss_type)
            errors[loss_type, beta] = abs(float(loss) - expected) / abs(expected)
            assert errors[loss_type, beta] <= 1e-5, (loss_type, beta, float(loss), expected)
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (
                    ("kl",) if beta else ()):
                assert abs(float(ours[name]) - figures[name]) <= 1e-5 * max(abs(figures[name]), 1e-3), name
            assert figures["clip_ratio/region_mean"] > 0  # the clip acts in this batch
    print("relative loss errors against TRL:", {f"{k[0]} beta={k[1]}": f"{v:.1e}" for k, v in errors.items()})
