"""A Mixtral's expert adapters in PEFT's form: LoRA on transformers 5's fused expert parameters.

transformers 5 holds a Mixtral block's experts as two parameters of one module
`mlp.experts`: `gate_up_proj` [experts, 2 * d_ff, d_model] (gate rows, then
up) and `down_proj` [experts, d_model, d_ff]. PEFT adapts them through
`target_parameters`: `lora_A.weight` [r * experts, in] holds expert e's A in
rows e * r ..., `lora_B.weight` [out, r * experts] its B in columns k * experts
+ e, and each expert's weight gets (lora_alpha / r) B_e A_e. With both
parameters targeted PEFT nests its wrappers: `gate_up_proj`'s pair is under
`mlp.experts.base_layer`, `down_proj`'s under `mlp.experts`.

jaxpar's gate and up experts have an A each; gate_up_proj has one A for both.
So gate_up_proj's adapter has rank 2r (`rank_pattern`, with `alpha_pattern`
2 alpha keeping the scale alpha / r): A_e stacks gate's and up's A, B_e is
block-diagonal, which is exactly the two adapters (an absent one is zero).
Read back (`read_layer`), a gate_up_proj adapter of rank r gives gate and up
each a copy of A_e and their rows of B_e; one of rank 2r (rank_pattern, as
jaxpar exports it) gives gate the first r rows of A_e and its block of B_e, up
the next r and its block, and is refused unless B_e is block-diagonal (else it
is no pair of rank-r adapters).
"""

from __future__ import annotations

import numpy as np

EXPERTS = "mlp.experts"
# the fused parameter -> jaxpar's expert weights in its rows (gate before up, as transformers concatenates them)
FUSED = {"gate_up_proj": ("expert_gate", "expert_up"), "down_proj": ("expert_down",)}


def fused_targets(adapted: set[str]) -> list[str]:
    """The fused parameters (gate_up_proj, down_proj) whose rows hold an adapted expert weight."""
    return [fused for fused, names in FUSED.items() if adapted & set(names)]


def config_fields(fused: list[str], rank: int, alpha: float) -> dict:
    """adapter_config.json's target_parameters, rank_pattern and alpha_pattern for `fused`."""
    doubled = "gate_up_proj" in fused
    return {"target_parameters": [f"{EXPERTS}.{f}" for f in fused],
            "rank_pattern": {"gate_up_proj": 2 * rank} if doubled else {},
            "alpha_pattern": {"gate_up_proj": 2 * alpha} if doubled else {}}


def layer_tensors(prefix: str, pairs: dict[str, tuple[np.ndarray, np.ndarray]], rank: int) -> dict[str, np.ndarray]:
    """PEFT's tensors of one layer's expert adapters; `pairs`: expert weight name -> (A [experts, in, r],
    B [experts, r, out]), `prefix` the layer's module path ('base_model.model.model.layers.0.')."""
    fused = fused_targets(set(pairs))
    out = {}
    for name in fused:
        blocks = [pairs.get(weight) for weight in FUSED[name]]
        like_a, like_b = next(pair for pair in blocks if pair is not None)
        blocks = [pair or (np.zeros_like(like_a), np.zeros_like(like_b)) for pair in blocks]
        a = np.concatenate([a.transpose(0, 2, 1) for a, _ in blocks], axis=1)  # [experts, n r, in]
        b = np.zeros((a.shape[0], sum(b.shape[2] for _, b in blocks), len(blocks) * rank), a.dtype)
        for j, (_, block) in enumerate(blocks):  # block-diagonal: [experts, n out, n r]
            rows = slice(j * block.shape[2], (j + 1) * block.shape[2])
            b[:, rows, j * rank:(j + 1) * rank] = block.transpose(0, 2, 1)
        module = f"{prefix}{EXPERTS}{'.base_layer' if len(fused) == 2 and name == 'gate_up_proj' else ''}"
        out[f"{module}.lora_A.weight"] = a.reshape(-1, a.shape[-1])
        out[f"{module}.lora_B.weight"] = b.transpose(1, 2, 0).reshape(b.shape[1], -1)
    return out


def read_layer(read, prefix: str, shapes: dict[str, tuple[int, int, int]], rank: int, doubled: bool = False) -> dict:
    """One layer's expert adapters in jaxpar's layout from PEFT's tensors: expert weight name -> (A [experts, in,
    r], B [experts, r, out]), plus "names", the tensors read. `read(name, shape)` gives a checked tensor; `shapes`:
    each fused parameter's (experts, in, out) as PEFT sees it (gate_up_proj: out = 2 d_ff); `doubled`:
    gate_up_proj's adapter has rank 2r (rank_pattern)."""
    out, names = {}, []
    for name, (experts, d_in, d_out) in shapes.items():
        module = f"{prefix}{EXPERTS}{'.base_layer' if len(shapes) == 2 and name == 'gate_up_proj' else ''}"
        names += [f"{module}.lora_A.weight", f"{module}.lora_B.weight"]
        parts = FUSED[name]
        held = rank * len(parts) if doubled and name == "gate_up_proj" else rank
        a = read(names[-2], (held * experts, d_in)).reshape(experts, held, d_in).transpose(0, 2, 1)
        b = read(names[-1], (d_out, held * experts)).reshape(d_out, held, experts).transpose(2, 1, 0)
        rows = d_out // len(parts)
        for j, weight in enumerate(parts):  # gate_up_proj's rows: gate's, then up's
            ranks = slice(j * rank, (j + 1) * rank) if held > rank else slice(None)
            out[weight] = (a[:, :, ranks], b[:, ranks, j * rows:(j + 1) * rows])
            if held > rank and np.any(np.delete(b[:, ranks], np.s_[j * rows:(j + 1) * rows], axis=2)):
                raise ValueError(f"{names[-1]} (rank {held}) is not gate's and up's two rank-{rank} adapters: its "
                                 f"rank block {j} reaches the other's rows (B not block-diagonal)")
    return {**out, "names": names}
