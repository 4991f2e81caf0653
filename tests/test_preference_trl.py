"""Preference objectives against TRL 1.16 on a tiny Llama and a fixed batch: DPO (each loss), SimPO (CPO), ORPO.

The same pairs as TRL's own collators build them, packed by jaxpar two documents a row; loss, chosen and
rejected rewards and margins within 1e-5 relative. Skipped where trl is not installed (the `test` extra on
Python 3.11 carries it).
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.data.packing import Document
from jaxpar.data.preference import pack_pairs
from jaxpar.interop import hf
from jaxpar.models.llama import Llama
from jaxpar.objectives import REFERENCE, Preference, reference_logps

trl = pytest.importorskip("trl", reason="needs trl (the `test` extra on Python 3.11)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

RECORDS = [{"prompt": "5 6 7", "chosen": " 8 9", "rejected": " 10"},
           {"prompt": "11 12", "chosen": " 13", "rejected": " 14 15 16"},
           {"prompt": "20 21 22 23", "chosen": " 24 25 26", "rejected": " 27 28"}]
SEQ = 24


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", *map(str, range(200))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="</s>")


def hf_model(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                                   max_position_embeddings=64, rms_norm_eps=1e-6)
    return transformers.LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy, reference) as transformers models and as jaxpar modules (the reference the policy perturbed)."""
    policy = hf_model(0)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = []
    for name, m in (("policy", policy), ("reference", reference)):
        folder = tmp_path_factory.mktemp(name)
        m.save_pretrained(folder)
        cfg, params = hf.load_hf_params(folder)
        with nnx.use_eager_sharding(False):
            graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(1)))
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
        ours.append(nnx.merge(graphdef, state))
    return policy, reference, ours[0], ours[1]


def trainer(kind: str, policy, reference, out, **options):
    data = datasets.Dataset.from_list(RECORDS)
    common = dict(output_dir=str(out), report_to=[], per_device_train_batch_size=len(RECORDS), use_cpu=True, bf16=False)
    if kind == "dpo":
        args = trl.DPOConfig(**common, **options)
        return trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer(),
                              train_dataset=data)
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    make, config = (CPOTrainer, CPOConfig) if kind == "cpo" else (ORPOTrainer, ORPOConfig)
    return make(model=policy, args=config(**common, max_length=SEQ, **options), processing_class=tokenizer(),
                train_dataset=data)


def pairs_of_dpo(batch) -> list:
    """TRL DPO's collated rows (chosen rows, then rejected rows) as (chosen, rejected) documents."""
    ids, attn, completion = (batch[k].numpy() for k in ("input_ids", "attention_mask", "completion_mask"))
    docs = [Document(i[a > 0], c[a > 0].astype(np.float32)) for i, a, c in zip(ids, attn, completion)]
    n = len(docs) // 2
    return list(zip(docs[:n], docs[n:]))


def pairs_of_cpo(batch) -> list:
    """CPO/ORPO's collated chosen_/rejected_ input ids and labels (-100 off the answer) as documents."""
    def docs(side):
        ids, attn, labels = (batch[f"{side}_{k}"].numpy() for k in ("input_ids", "attention_mask", "labels"))
        return [Document(i[a > 0], (l[a > 0] != -100).astype(np.float32)) for i, a, l in zip(ids, attn, labels)]

    return list(zip(docs("chosen"), docs("rejected")))


def ours(objective: Preference, pairs, policy, reference=None):
    batch = {k: jnp.asarray(v) for k, v in pack_pairs(pairs, SEQ, sft=objective.sft).items()}
    if "loss_weights" in batch:  # as the step normalises them over the global batch
        batch["loss_weights"] = batch["loss_weights"] / jnp.mean(batch["loss_weights"])
    if reference is not None:
        batch[REFERENCE] = jax.jit(lambda m, b: reference_logps(m, b))(reference, batch)
    loss, metrics = jax.jit(lambda m, b: objective(m, b))(policy, batch)
    return float(loss), {k: float(v) for k, v in metrics.items()}


def close(a, b, what):
    assert abs(a - b) <= 1e-5 * max(abs(b), 1e-6), f"{what}: jaxpar {a} TRL {b}"


@pytest.fixture(scope="module")
def dpo_trainer(models, tmp_path_factory):
    policy, reference, *_ = models
    return trainer("dpo", policy, reference, tmp_path_factory.mktemp("dpo"), beta=0.1)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)])
def test_dpo_matches_trl(models, dpo_trainer, loss_type, smoothing):
    *_, policy, reference = models
    tr = dpo_trainer
    tr.loss_types, tr.loss_weights, tr.label_smoothing, tr.beta = [loss_type], [1.0], smoothing, 0.5
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(RECORDS))])
    tr._metrics["train"].clear()
    tr.model.train()
    with torch.no_grad():
        expected = float(tr.compute_loss(tr.model, batch))
    trl_metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    loss, metrics = ours(Preference("dpo", beta=0.5, dpo_loss=loss_type, label_smoothing=smoothing),
                         pairs_of_dpo(batch), policy, reference)
    close(loss, expected, "loss")
    for name, theirs in (("chosen_reward", "rewards/chosen"), ("rejected_reward", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                         ("chosen_logps", "logps/chosen"), ("rejected_logps", "logps/rejected")):
        close(metrics[name], trl_metrics[theirs], name)


@pytest.mark.parametrize("kind,options", [("simpo", dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0)),
                                          ("simpo", dict(beta=2.0, simpo_gamma=1.0, cpo_alpha=1.0,
                                                         label_smoothing=0.1)),
                                          ("orpo", dict(beta=0.1))])
def test_simpo_and_orpo_match_trl(models, tmp_path, kind, options):
    policy_hf, _, policy, _ = models
    if kind == "simpo":
        tr = trainer("cpo", policy_hf, None, tmp_path, loss_type="simpo", **options)
        objective = Preference("simpo", beta=options["beta"], simpo_gamma=options["simpo_gamma"],
                               sft_weight=options["cpo_alpha"], label_smoothing=options.get("label_smoothing", 0.0))
    else:
        tr = trainer("orpo", policy_hf, None, tmp_path, **options)
        objective = Preference("orpo", beta=options["beta"])
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(RECORDS))])
    tr.model.train()
    with torch.no_grad():
        expected, trl_metrics = tr.get_batch_loss_metrics(tr.model, batch)
    loss, metrics = ours(objective, pairs_of_cpo(batch), policy)
    close(loss, float(expected), "loss")
    names = [("chosen_reward", "rewards/chosen"), ("rejected_reward", "rewards/rejected"),
             ("reward_margin", "rewards/margins"), ("chosen_logps", "logps/chosen")]
    if kind == "orpo":
        names += [(name, name) for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen")]
    for name, theirs in names:
        close(metrics[name], float(trl_metrics[theirs]), name)
