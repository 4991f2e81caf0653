"""The search over layouts: enumerate those worth considering, drop the ones that cannot run or do not fit
(with the reason), rank the rest by predicted step time, and say why the best one wins.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jaxpar.pipeline.schedule import validate
from jaxpar.planner.devices import Device, load_device
from jaxpar.planner.estimate import Estimate, estimate
from jaxpar.planner.layout import REMATS, Layout, Workload
from jaxpar.planner.model import Model


PIPELINES = (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4))  # (schedule, chunks)


def runs_pipeline(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> bool:
    """Whether the executor runs `schedule` with these counts: its own check (jaxpar.pipeline.schedule.validate:
    at least one microbatch per stage, interleaved's groups of p), not a copy of it."""
    try:
        validate(schedule, stages, microbatches, virtual_stages)
    except ValueError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(model: Model, devices: int, work: Workload, device: Device, precision: str = "bf16",
            max_tensor: int | None = None, contexts: tuple[int, ...] = (1,), offload: str = "none") -> list[Layout]:
    """Every layout worth considering for `devices`: mesh factorisations x ZeRO x schedule x microbatch x remat,
    with each context size of `contexts` that splits the sequence (both attention forms), offloading or not."""
    max_tensor = max_tensor or device.devices_per_node
    out = []
    kv = model.n_kv_heads  # fewer key/value heads than tensor ranks are replicated (jaxpar.parallel.tensor)
    tensors = [t for t in _divisors(devices)
               if t <= max_tensor and model.n_heads % t == 0 and (kv % t == 0 or t % kv == 0) or t == 1]
    experts = [e for e in _divisors(devices) if model.n_experts and model.n_experts % e == 0] or [1]
    for t, e, c in itertools.product(tensors, experts, contexts):
        if c > 1 and (devices % (t * e * c) or work.seq_len % (2 * c)):
            continue
        for p in _divisors(devices // (t * e * c)):
            if model.pipeline_units % p or (p > 1 and c > 1):
                continue
            n = devices // (t * e * p * c)
            local = work.batch_size / (n * e)
            if local != int(local) or local < 1:
                continue
            for b in (1, 2, 4, 8, 16, 32):
                if int(local) % b:
                    continue
                steps = int(local) // b
                for z in (0, 1, 2, 3) if n > 1 else (0,):
                    for remat in REMATS:
                        for sp in ((False, True) if t > 1 else (False,)):
                            if p == 1:
                                # context with tensor: the explicit form (jax >= 0.12 refuses the annotation form there)
                                tensor_form = "explicit" if c > 1 and t > 1 else "annotation"
                                for form in ("all-gather", "ring") if c > 1 else ("all-gather",):
                                    out.append(Layout(n, t, 1, e, z, grad_accum=steps, remat=remat, precision=precision,
                                                      sequence_parallel=sp, tensor_form=tensor_form, context=c,
                                                      context_form=form))
                                continue
                            for sched, v in PIPELINES:
                                if not runs_pipeline(sched, p, steps, v) or model.pipeline_units % (p * v):
                                    continue
                                out.append(Layout(n, t, p, e, z, sched, steps, v, remat=remat, precision=precision,
                                                  sequence_parallel=sp))
    moe = moe_options(model, device)
    return [dataclasses.replace(layout, offload=offload, **moe) for layout in out] if offload != "none" or moe \
        else out


def moe_options(model: Model, device: Device) -> dict:
    """The MoE kernel a layout is counted in, named in its plan: tiled for a dropless model (the sorted rows, in
    memory of the routed rows), buffered for a capacity-routed one; the exchange over `expert` the device has."""
    if not model.n_experts:
        return {}
    kernel = "tiled" if model.dropless else "buffered"
    return {"moe_kernel": kernel, "moe_exchange": "ragged" if device.ragged_exchange and model.dropless else "buffers"}


@dataclasses.dataclass
class Ranking:
    """The result of `plan`: fitting layouts best first, and the ones dropped with their reasons."""

    model: Model
    work: Workload
    device: Device
    devices: int
    ranked: list[Estimate]
    dropped: list[Estimate]
    instead_of: "Ranking | None" = None  # the precision asked for, when no layout fit in it (`plan`)

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self, top: int = 10) -> dict:
        reasons: dict[str, int] = {}
        for est in self.dropped:
            key = est.reason.split(",")[0] if "needs" not in est.reason else "does not fit in memory"
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "model": self.model.name, "params": self.model.params, "devices": self.devices,
            "device": self.device.to_dict(), "batch_size": self.work.batch_size, "seq_len": self.work.seq_len,
            "considered": len(self.ranked) + len(self.dropped), "fitting": len(self.ranked),
            "dropped_reasons": reasons, "top": [e.to_dict() for e in self.ranked[:top]],
            "explanation": explain_choice(self),
            **({"instead_of": {"precision": nearest(self.instead_of.dropped).layout.precision,
                               "nearest": str(nearest(self.instead_of.dropped).layout),
                               "reason": nearest(self.instead_of.dropped).reason}} if self.instead_of else {}),
            "ranked": [{"layout": str(e.layout), "step_time": e.step_time, "mfu": e.mfu, "memory": e.peak}
                       for e in self.ranked],
            "dropped": [{"layout": str(e.layout), "reason": e.reason} for e in self.dropped],
        }


def plan(model: Model, devices: int, work: Workload, device: Device | str = "h100", precision: str = "bf16") -> Ranking:
    """Enumerate the layouts for `devices`, drop those that cannot run or do not fit, rank by step time.

    Context parallelism joins the candidates when no layout without it fits (a sequence too long for
    one device's share of the attention), then host offload of the optimizer state when none fits still.
    When none fits with an fp32 master (bf16, fp16), the layouts that hold the parameters in bf16
    (`bf16-params`) are ranked instead, the ranking asked for kept in `instead_of` to say so.
    """
    device = load_device(device) if isinstance(device, str) else device
    ranking = _ranking(model, devices, work, device, precision)
    if ranking.ranked or precision not in FALLBACK:
        return ranking
    other = _ranking(model, devices, work, device, FALLBACK[precision])
    return dataclasses.replace(other, instead_of=ranking) if other.ranked else ranking


FALLBACK = {"bf16": "bf16-params", "fp16": "bf16-params"}  # no fp32 master: 6 bytes of state per parameter, not 12


def _ranking(model: Model, devices: int, work: Workload, device: Device, precision: str) -> Ranking:
    ranked, dropped = [], []
    split = tuple(c for c in _divisors(devices) if 1 < c <= device.devices_per_node)
    for contexts, offload in (((1,), "none"), (split, "none"), ((1, *split), "optimizer")):
        for layout in layouts(model, devices, work, device, precision, contexts=contexts, offload=offload):
            est = estimate(model, layout, work, device)
            (ranked if est.fits else dropped).append(est)
        if ranked:
            break
    ranked.sort(key=lambda e: (e.step_time, e.peak))
    return Ranking(model, work, device, devices, ranked, dropped)


def nearest(dropped: list[Estimate]) -> Estimate:
    """The dropped layout to name: the one that needs the least memory, if any was dropped for memory (what the
    first one considered, plain data parallelism, needs says nothing of how far the model is from fitting)."""
    oom = [e for e in dropped if "needs" in e.reason]
    return min(oom, key=lambda e: e.memory["total"]) if oom else dropped[0]


def default_batch(model: Model, devices: int, seq_len: int) -> int:
    """A global batch of about 4M tokens (Llama 2's), at least one sequence per 8 devices."""
    tokens = max(4 * 2**20 // seq_len, 1)
    return max(2 ** round(math.log2(tokens)), 2 ** math.ceil(math.log2(max(devices // 8, 1))))


def explain_choice(ranking: Ranking) -> list[str]:
    """A few lines on why the best layout wins: its bottleneck and what the runner-up layouts lose."""
    best = ranking.best
    if best is None:
        if not ranking.dropped:
            return ["no layout fits: none considered"]
        closest = nearest(ranking.dropped)
        return [f"no layout fits: the nearest, {closest.layout}, {closest.reason}"]
    lay, t = best.layout, best.time
    lines = [] if ranking.instead_of is None else [instead(ranking)]
    lines += [f"{lay}: {t['step']:.3g} s/step, MFU {best.mfu:.0%}, {best.peak / 1e9:.1f} GB per device "
             f"of {ranking.device.capacity / 1e9:.0f} GB usable."]
    exposed = t["comm_tensor"] + t["comm_pipe"] + t["comm_expert"] + t["exposed_data"]
    lines.append(f"compute {t['compute']:.3g} s (bubble {best.bubble:.1%}), exposed communication "
                 f"{exposed:.3g} s (tensor {t['comm_tensor']:.3g}, pipe {t['comm_pipe']:.3g}, data "
                 f"{t['exposed_data']:.3g} of {t['comm_data']:.3g} not hidden by the backward pass).")
    if lay.tensor > 1:
        lines.append(f"tensor={lay.tensor} stays inside a node ({ranking.device.devices_per_node} devices) on "
                     f"{ranking.device.intra_bandwidth / 1e9:.0f} GB/s links; it splits the weights and activations "
                     f"that data parallelism alone would not fit.")
    if lay.pipe > 1:
        lines.append(f"pipe={lay.pipe} with {lay.microbatches} microbatches ({lay.schedule}) keeps the bubble at "
                     f"{best.bubble:.1%} while cutting each device's layers to {ranking.model.n_layers // lay.pipe}.")
    if lay.zero:
        lines.append(f"ZeRO-{lay.zero} shards the optimizer state{' and gradients' if lay.zero >= 2 else ''}"
                     f"{' and parameters' if lay.zero == 3 else ''} over data={lay.data}.")
    others = {}
    for est in ranking.ranked[1:]:
        key = (est.layout.tensor, est.layout.pipe, est.layout.data)
        if key != (lay.tensor, lay.pipe, lay.data) and key not in others:
            others[key] = est
        if len(others) == 2:
            break
    for est in others.values():
        lines.append(f"runner-up {est.layout.mesh}: {est.step_time / t['step']:.2f}x the step time "
                     f"({_bottleneck(est)}).")
    oom = [e for e in ranking.dropped if "needs" in e.reason]
    if oom:
        fastest = min(oom, key=lambda e: e.step_time)
        lines.append(f"{len(oom)} layouts do not fit (the fastest of them, {fastest.layout}, "
                     f"{fastest.reason}); {len(ranking.dropped) - len(oom)} cannot run the model.")
    return lines


def instead(ranking: Ranking) -> str:
    """Why the ranking holds another precision than the one asked for: the nearest layout in it, and what differs."""
    asked = ranking.instead_of
    closest = nearest(asked.dropped)
    precision = closest.layout.precision
    return (f"no layout fits with precision={precision} (fp32 master parameters beside Adam's two fp32 moments, "
            f"and under gradient accumulation their fp32 accumulators): the nearest, {closest.layout}, {closest.reason}. The layouts below hold the parameters "
            f"and moments in bf16 instead (precision={ranking.best.layout.precision}, no fp32 master: updates "
            f"smaller than a bf16 step of a weight are rounded away); pass --precision to choose.")


def _bottleneck(est: Estimate) -> str:
    t = est.time
    costs = {"bubble": t["compute"] * est.bubble, "tensor traffic": t["comm_tensor"], "pipe traffic": t["comm_pipe"],
             "data traffic": t["exposed_data"], "expert traffic": t["comm_expert"],
             "recomputation": t["compute"] * (1 - est.flops / est.hardware_flops) if est.hardware_flops else 0.0}
    name, cost = max(costs.items(), key=lambda kv: kv[1])
    return f"mostly {name}, {cost:.3g} s"
