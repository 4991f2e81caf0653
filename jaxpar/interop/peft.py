"""LoRA adapters in and out as PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`).

A PEFT adapter on a Hugging Face model is, for each targeted `nn.Linear`
(`model.layers.{i}.self_attn.q_proj`), `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] with W' = W + (lora_alpha / r) B A in torch's [out, in]
layout. jaxpar's adapter beside a weight is A [layers, in..., r] and B
[layers, r, out...] with W' = W + (alpha / r) A B in [in, out]; a heads
dimension and head_dim flatten in the order torch's rows and columns hold them
(`jaxpar.interop.hf_families`' layouts), so each layer's PEFT pair is A and B
flattened and transposed.

`export_peft` writes a LoRA checkpoint's adapters (`jaxpar export --format
peft`); `adapter_options` and `read_adapter` read one back for `jaxpar train
--init-from BASE --adapter DIR`. A Mixtral's expert adapters go out as PEFT's
`target_parameters` on transformers 5's fused experts and come back from
them (`peft_experts`); an adapter PEFT cannot express is refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jaxpar.interop import hf_mixtral, peft_experts
from jaxpar.interop.export import CONFIG_FILE, unflatten
from jaxpar.interop.hf import saved_model_config
from jaxpar.interop.hf_write import SafetensorsFile, _numpy_dtype
from jaxpar.interop.saved_weights import parameter_reader
from jaxpar.interop.hf_config import is_hf_dir
from jaxpar.interop.hf_families import blocks_path, jaxpar_shapes, layer_params, moe_family
from jaxpar.interop.peft_experts import FUSED
from jaxpar.interop.safetensors_reader import SafetensorsReader
from jaxpar.models.llama import LlamaConfig
from jaxpar.parallel import lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's path to the wrapped model's modules
INPUT_DIMS = {"in_heads": 1, "out_heads": 2, "transpose": 1}  # layouts of a torch Linear: jaxpar's input dimensions
# PEFT LoRA options an adapter of jaxpar's kind leaves at these values (an adapter with others is refused)
PLAIN = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
         "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def _linear_targets(cfg: LlamaConfig) -> dict[str, str]:
    """jaxpar weight name ('wq') -> its torch module's name within a layer ('self_attn.q_proj'), for every weight
    that is one `nn.Linear` per layer (an MoE block's router and experts are not: transformers 5 names them
    otherwise in memory than in its files)."""
    moe = moe_family(cfg).LAYER_PARAMS if hf_mixtral.is_moe(cfg) else {}
    return {name: suffix.removesuffix(".weight") for name, (suffix, layout) in layer_params(cfg).items()
            if layout in INPUT_DIMS and name not in moe}


def peft_module(cfg: LlamaConfig, path: str) -> str:
    """The torch module name ('self_attn.q_proj') of an adapted weight ('blocks/wq'), or '' for a Mixtral expert
    weight (`jaxpar.interop.peft_experts`); ValueError naming one PEFT cannot hold."""
    name = path.removeprefix(f"{blocks_path(cfg)}/")
    targets = _linear_targets(cfg)
    if name in targets:
        return targets[name]
    if hf_mixtral.is_moe(cfg) and moe_family(cfg) is hf_mixtral and any(name in n for n in FUSED.values()):
        return ""
    what = f" ({layer_params(cfg)[name][0]})" if name in layer_params(cfg) else ""
    raise ValueError(f"--format peft: the adapter on {path}{what} has no PEFT form: PEFT adapts an nn.Linear per "
                     f"layer ({', '.join(sorted(set(targets.values())))}) and a Mixtral's fused experts")


def check_one_stack(cfg: LlamaConfig, what: str) -> None:
    """ValueError for a model whose blocks are two stacks (dense blocks among or before MoE ones: a Qwen3-MoE with
    decoder_sparse_step > 1, Llama 4 Maverick's layout, DeepSeek-V3): PEFT's layer numbering of their adapters is
    not written or read yet."""
    if any(name.startswith(("blocks/dense/", "blocks/prefix/")) for name in jaxpar_shapes(cfg)):
        raise ValueError(f"{what}: this model has dense blocks beside its MoE ones (two stacks of layers); PEFT "
                         "adapters of such a model are not supported yet: export with --format hf --merge")


def export_peft(path, out, step: int | None = None, dtype: str = "float32") -> dict:
    """`jaxpar export --format peft`: a LoRA checkpoint's adapters as a PEFT folder (they are small: held whole)."""
    path, out = Path(path), Path(out).absolute()
    np_dtype = _numpy_dtype(dtype)
    if out.exists():
        raise ValueError(f"export target {str(out)!r} already exists; choose another --out or remove it")
    _, cfg = saved_model_config(path)
    check_one_stack(cfg, "--format peft")
    with parameter_reader(path, cfg, step) as (read, saved_step, names):
        adapted = lora.adapted_names(names)
        if not adapted:
            raise ValueError(f"--format peft: {path} holds no LoRA adapters (train with --lora-rank)")
        modules = {p: peft_module(cfg, p) for p in adapted}
        pairs = {p: (np.asarray(read(p + lora.A)), np.asarray(read(p + lora.B))) for p in adapted}
        ranks = {a.shape[-1] for a, _ in pairs.values()}
        scales = {float(v) for p in adapted for v in np.asarray(read(p + lora.SCALE)).reshape(-1)}
    dropout = _run_plan(path).get("lora_dropout", 0.0)
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"--format peft: the adapters have ranks {sorted(ranks)} and scales {sorted(scales)}; a "
                         "PEFT adapter_config holds one r and one lora_alpha")
    (rank,), (scale,) = ranks, scales
    experts = {p.rsplit("/", 1)[-1]: pair for p, pair in pairs.items() if not modules[p]}
    tensors = {}
    for i in range(cfg.n_layers):
        layer = f"{PREFIX}model.layers.{i}."
        for p, (a, b) in pairs.items():
            if modules[p]:
                tensors[f"{layer}{modules[p]}.lora_A.weight"] = a[i].reshape(-1, rank).T
                tensors[f"{layer}{modules[p]}.lora_B.weight"] = b[i].reshape(rank, -1).T
        tensors.update(peft_experts.layer_tensors(layer, {k: (a[i], b[i]) for k, (a, b) in experts.items()}, rank))
    out.mkdir(parents=True)
    with SafetensorsFile(out / ADAPTER_WEIGHTS, {k: v.shape for k, v in tensors.items()}, np_dtype,
                         {"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules.values() if m}), "lora_dropout": dropout,
              "base_model_name_or_path": _base_name(path), "inference_mode": True,
              **PLAIN, **(peft_experts.config_fields(peft_experts.fused_targets(set(experts)), rank, scale * rank)
                          if experts else {})}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"path": str(out), "format": "peft", "step": saved_step, "r": rank, "lora_alpha": scale * rank,
            "target_modules": config["target_modules"], "target_parameters": config.get("target_parameters"),
            "tensors": len(tensors), "bytes": sum(t.size for t in tensors.values()) * np_dtype.itemsize}


def _base_name(path: Path) -> str | None:
    """What the checkpoint was trained on: its --init-from, or the Hugging Face source an import-hf came from."""
    init_from = _run_config(path).get("train", {}).get("init_from")
    return _import_source(init_from) if init_from else None


def _run_plan(path: Path) -> dict:
    """The plan options of the run that wrote the checkpoint (its lora_dropout: PEFT's adapter_config keeps it)."""
    return _run_config(path).get("plan") or {}


def _run_config(path: Path) -> dict:
    """The run config a training checkpoint keeps (empty for an export directory, which keeps none)."""
    from jaxpar.train.checkpoint import Checkpoints

    if (path / CONFIG_FILE).is_file():
        return {}
    with Checkpoints(path, read_only=True) as checkpoints:
        return {k: v or {} for k, v in (checkpoints.metadata()["config"] or {}).items()}


def _import_source(base: str) -> str:
    """The Hugging Face directory or Hub id an import-hf directory came from; `base` itself otherwise."""
    imported = Path(base) / CONFIG_FILE
    if not is_hf_dir(Path(base)) and imported.is_file():
        saved = json.loads(imported.read_text())
        return saved.get("source", base) if "hf_config" in saved else base
    return base


# -- an adapter in ------------------------------------------------------------------------------------------


def _read_config(directory: Path) -> dict:
    file = directory / ADAPTER_CONFIG
    if not file.is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"--adapter {directory}: not a PEFT adapter folder (needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS})")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"--adapter {directory}: peft_type {config.get('peft_type')!r}; jaxpar reads LORA adapters")
    other = {k: config[k] for k, v in PLAIN.items() if k in config and config[k] not in (v, None, [], {})}
    doubled = peft_experts.config_fields(["gate_up_proj"], int(config.get("r", 0)),
                                         float(config.get("lora_alpha", config.get("r", 0))))
    patterns = {k: config.get(k) or {} for k in ("rank_pattern", "alpha_pattern")}
    if patterns == {k: doubled[k] for k in patterns}:  # gate and up's A as one of rank 2r: jaxpar's own export
        other = {k: v for k, v in other.items() if k not in patterns}
    if other:
        raise ValueError(f"--adapter {directory}: {', '.join(f'{k}={v!r}' for k, v in other.items())} is not a "
                         "plain LoRA jaxpar can train (W + (lora_alpha / r) B A on whole linear layers)")
    if not isinstance(config.get("target_modules"), list):
        raise ValueError(f"--adapter {directory}: target_modules={config.get('target_modules')!r}; jaxpar reads a "
                         "list of module names (q_proj, v_proj, ...)")
    fused = [f"{peft_experts.EXPERTS}.{name}" for name in FUSED]
    other = [t for t in config.get("target_parameters") or [] if t not in fused]
    if other:
        raise ValueError(f"--adapter {directory}: target_parameters {other} are not parameters jaxpar adapts "
                         f"({', '.join(fused)})")
    return config


def adapter_options(directory, given: dict) -> dict:
    """The plan's lora_rank, lora_alpha and lora_targets from an adapter's config; ValueError naming an option
    `given` (the --lora-* flags or [lora] keys set) that says otherwise."""
    directory = Path(directory)
    config = _read_config(directory)
    short = {f"{name}_proj": name for name in lora.SHORT_NAMES}  # q_proj -> q, ..., down_proj -> down
    unknown = [m for m in config["target_modules"] if m not in short]
    if unknown:
        raise ValueError(f"--adapter {directory}: target_modules {unknown} are not linear layers jaxpar adapts "
                         f"({', '.join(short)})")
    targets = {short[m] for m in config["target_modules"]} | {  # a Mixtral's fused experts: gate_up_proj -> gate, up
        t.removeprefix("expert_") for p in config.get("target_parameters") or [] for t in FUSED[p.rsplit(".", 1)[-1]]}
    options = {"lora_rank": int(config["r"]), "lora_alpha": float(config.get("lora_alpha", config["r"])),
               "lora_targets": tuple(t for t in lora.SHORT_NAMES if t in targets)}
    for key, value in options.items():
        if given.get(key) not in (None, value, *((",".join(value), list(value)) if key == "lora_targets" else ())):
            raise ValueError(f"--{key.replace('_', '-')} {given[key]} conflicts with --adapter {directory}, whose "
                             f"adapter_config.json says {value}; drop the flag (the adapter decides)")
    # dropout is how training goes on, not the adapter's shape: a --lora-dropout given says otherwise
    dropout = given.get("lora_dropout")
    return {**options, "lora_dropout": float(config.get("lora_dropout") or 0.0) if dropout is None else dropout}


def read_adapter(directory, cfg: LlamaConfig, base: str) -> dict:
    """The adapter's A and B in jaxpar's layout, stacked over layers, as the parameter tree's nested dict.

    ValueError if the adapter names another base than `base` (the --init-from path, or the source it was
    imported from) or its tensors do not fit `cfg`'s shapes.
    """
    directory = Path(directory)
    check_one_stack(cfg, f"--adapter {directory}")
    config = _read_config(directory)
    _check_base(directory, config.get("base_model_name_or_path"), base)
    targets = {module.rsplit(".", 1)[-1]: name for name, module in _linear_targets(cfg).items()}
    shapes, rank = jaxpar_shapes(cfg), int(config["r"])
    reader = SafetensorsReader(directory)
    try:
        flat, expected = {}, set()
        for module in config["target_modules"]:
            if module not in targets:
                raise ValueError(f"--adapter {directory}: target_modules {module} is no linear layer of {base} "
                                 f"({', '.join(targets)}); the adapter was made for another base")
            name = targets[module]
            path, layout = f"{blocks_path(cfg)}/{name}", layer_params(cfg)[name][1]
            d_in, d_out = shapes[path][1:1 + INPUT_DIMS[layout]], shapes[path][1 + INPUT_DIMS[layout]:]
            a_layers, b_layers = [], []
            for i in range(cfg.n_layers):
                prefix = f"{PREFIX}model.layers.{i}.{_linear_targets(cfg)[name]}"
                a, b = _tensor(reader, f"{prefix}.lora_A.weight", (rank, math.prod(d_in)), base), \
                    _tensor(reader, f"{prefix}.lora_B.weight", (math.prod(d_out), rank), base)
                expected |= {f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"}
                a_layers.append(a.T.reshape(*d_in, rank))
                b_layers.append(b.T.reshape(rank, *d_out))
            flat[path + lora.A], flat[path + lora.B] = np.stack(a_layers), np.stack(b_layers)
        fused = [p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or []]
        if fused and not (hf_mixtral.is_moe(cfg) and moe_family(cfg) is hf_mixtral):
            raise ValueError(f"--adapter {directory}: target_parameters {config['target_parameters']} are a "
                             f"Mixtral's experts; {base} is not a Mixtral")
        if fused:
            shapes = {name: (cfg.n_experts, cfg.expert_d_ff if name == "down_proj" else cfg.d_model,
                             cfg.d_model if name == "down_proj" else 2 * cfg.expert_d_ff) for name in fused}
            doubled = bool(config.get("rank_pattern"))  # gate_up_proj's adapter of rank 2r (checked above)
            layers = [peft_experts.read_layer(lambda name, shape: _tensor(reader, name, shape, base),
                                              f"{PREFIX}model.layers.{i}.", shapes, rank, doubled)
                      for i in range(cfg.n_layers)]
            expected |= {name for layer in layers for name in layer.pop("names")}
            for name in layers[0]:
                for what, j in ((lora.A, 0), (lora.B, 1)):
                    flat[f"{blocks_path(cfg)}/{name}{what}"] = np.stack([layer[name][j] for layer in layers])
        extra = sorted(set(reader.files) - expected)
        if extra:
            raise ValueError(f"--adapter {directory}: tensors {extra[:4]} are not on the targets of a {cfg.n_layers}-"
                             f"layer {base} (target_modules {config['target_modules']})")
    finally:
        reader.close()
    return unflatten(flat)


def _tensor(reader: SafetensorsReader, name: str, shape: tuple[int, ...], base: str) -> np.ndarray:
    if name not in reader:
        raise ValueError(f"--adapter {reader.directory}: {name} is missing; the adapter does not fit {base}")
    if tuple(reader.shape(name)) != shape:
        raise ValueError(f"--adapter {reader.directory}: {name} has shape {list(reader.shape(name))}, {base} needs "
                         f"{list(shape)}; the adapter was made for another base")
    return reader.read(name).astype(np.float32)


def _check_base(directory: Path, named: str | None, base: str) -> None:
    """ValueError if the adapter's base_model_name_or_path names another model than `base`: a local path must be
    `base` or the directory it was imported from; a Hub id (no such path here) must end in that one's name."""
    if not named:
        return
    candidates = {Path(base).absolute(), Path(_import_source(base)).absolute()}
    if Path(named).exists():
        fits = Path(named).absolute() in candidates
    else:
        fits = named.rstrip("/").rsplit("/", 1)[-1] in {c.name for c in candidates}
    if not fits:
        raise ValueError(f"--adapter {directory} was made for {named}, not --init-from {base}; give the adapter's "
                         "base model")
