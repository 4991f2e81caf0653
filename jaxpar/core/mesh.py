"""The named device mesh: six axes that always exist, sizes from text, TOML or Python.

Axis order puts `tensor` innermost, then `context`, so that on GPU/TPU hosts
the axes with the most traffic per step land on the fastest links (NVLink /
ICI neighbours); `replica`, then `data`, are outermost so that on several
hosts they are the axes that cross the slower network (DCN). `replica` is a
second batch axis for HSDP: ZeRO shards within `data` (one host) and only
all-reduces the shards over `replica` (across hosts); see `jaxpar.parallel.zero`.

The order of the axis names also decides how jaxpar's shard_maps may nest:
XLA requires the manual axes of a nested shard_map to be sorted by mesh
position, so a nested one may only add axes that come later in the mesh. The
step's shard_map is manual over its own axes from the outset (`replica`, `data`, every
axis of size 1, `tensor` under the explicit form: `Plan.step_manual_axes`);
a pipeline inside it adds `pipe`, an MoE layer `expert`, context-parallel
attention `context` (inside a pipeline stage too), an annotation-form
collective `tensor`. `nesting_order` puts the axes in that order; it transposes
the device grid along with the names, so no device changes place.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from importlib import resources
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("replica", "data", "pipe", "expert", "context", "tensor")  # outermost first; a new axis is one more name here


@dataclasses.dataclass(frozen=True, init=False)
class MeshSpec:
    """Sizes of the named axes (`AXES`, each 1 unless given); one may be -1 (the rest of the devices).

    `MeshSpec(data=4, tensor=2)`. `dcn` gives, per axis, how many of its slices
    span hosts (multi-host only): `MeshSpec(data=8, dcn={"data": 2})` on two
    hosts of four devices each puts the two halves of `data` on different hosts
    and everything else inside one.
    """

    sizes: dict[str, int]
    dcn: dict[str, int]

    def __init__(self, dcn: dict[str, int] | None = None, **sizes: int):
        for axis in (*sizes, *(dcn or {})):
            if axis not in AXES:
                raise ValueError(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)}")
        object.__setattr__(self, "sizes", {a: sizes.get(a, 1) for a in AXES})
        object.__setattr__(self, "dcn", dict(dcn or {}))
        wild = [a for a in AXES if self.size(a) == -1]
        if len(wild) > 1:
            raise ValueError(f"only one mesh axis may be -1, got {wild}")
        for axis in AXES:
            if self.size(axis) == 0 or self.size(axis) < -1:
                raise ValueError(f"mesh axis {axis!r} must be a positive size or -1, got {self.size(axis)}")

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.sizes)

    def resolve(self, num_devices: int) -> "MeshSpec":
        """Fill in a -1 axis and check that the product equals the device count."""
        known = math.prod(s for s in self.shape.values() if s != -1)
        sizes = self.shape
        wild = [a for a, s in sizes.items() if s == -1]
        if wild:
            if num_devices % known:
                raise ValueError(
                    f"mesh axis {wild[0]!r}=-1: {num_devices} devices do not divide by the "
                    f"product {known} of the other axes {self._describe(sizes)}"
                )
            sizes[wild[0]] = num_devices // known
        total = math.prod(sizes.values())
        if total != num_devices:
            raise ValueError(
                f"mesh {self._describe(sizes)} has {total} devices but {num_devices} are available; "
                f"make the product of the axis sizes equal {num_devices} (or set one axis to -1)"
            )
        return MeshSpec(dcn=self.dcn, **sizes)

    @staticmethod
    def _describe(sizes: dict[str, int]) -> str:
        return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "data=1"

    def __str__(self) -> str:
        return self._describe(self.shape)


def parse_mesh(text: str | None) -> tuple[MeshSpec, dict]:
    """Read a mesh from `data=4,tensor=2`, a TOML file, or a preset name in `meshes/`.

    Returns the spec and the preset's `[plan]` table (empty for inline text), so a
    preset such as `zero3-8` can carry plan options along with its mesh.
    """
    if text is None or text == "":
        return MeshSpec(data=-1), {}
    if "=" in text and not text.endswith(".toml"):
        return _parse_inline(text), {}
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ValueError(f"mesh file {text!r} does not exist")
        return _parse_toml(path.read_text(), source=str(path))
    presets = available_presets()
    if text not in presets:
        raise ValueError(
            f"unknown mesh {text!r}: give axis sizes like data=4,tensor=2, a .toml file, "
            f"or one of the presets {sorted(presets)}"
        )
    return _parse_toml(presets[text], source=f"preset {text}")


def available_presets() -> dict[str, str]:
    folder = resources.files("jaxpar.meshes")
    return {p.name[: -len(".toml")]: p.read_text() for p in folder.iterdir() if p.name.endswith(".toml")}


def _parse_inline(text: str) -> MeshSpec:
    sizes = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; axes are {', '.join(AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs an integer size, got {value!r}") from None
    return MeshSpec(**sizes)


def _parse_toml(text: str, source: str) -> tuple[MeshSpec, dict]:
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{source} is not valid TOML: {error}") from None
    unknown = set(table) - {"mesh", "plan", "description"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; allowed: mesh, plan, description")
    plan = table.get("plan", {})
    if not isinstance(plan, dict):
        raise ValueError(f"{source}: plan must be a table ([plan]), got {plan!r}")
    return mesh_from_table(table.get("mesh", {}), source), dict(plan)


def mesh_from_table(table: dict, source: str) -> MeshSpec:
    """A MeshSpec from a TOML `[mesh]` table (a mesh file's or a `--config` file's), every key and size checked."""
    if not isinstance(table, dict):
        raise ValueError(f"{source}: mesh must be a table ([mesh] with axis sizes), got {table!r}")
    mesh = dict(table)
    dcn = mesh.pop("dcn", {})
    bad = set(mesh) - set(AXES)
    if bad:
        raise ValueError(f"{source}: unknown mesh axes {sorted(bad)} in [mesh]; axes are {', '.join(AXES)}")
    if not isinstance(dcn, dict):
        raise ValueError(f"{source}: [mesh] dcn must be a table of axis sizes, got {dcn!r}")
    for name, size in [*mesh.items(), *((f"dcn.{a}", n) for a, n in dcn.items())]:
        if not isinstance(size, int) or isinstance(size, bool):
            raise ValueError(f"{source}: mesh axis {name!r} needs an integer size, got {size!r}")
    return MeshSpec(**mesh, dcn=dcn)


def make_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """Build the jax Mesh (Auto axis types: GSPMD places collectives from annotations).

    On one host, `jax.make_mesh` orders devices so that inner axes get the fastest
    links. Across hosts, axes named in `spec.dcn` are split into a per-host part
    and a cross-host part with `create_hybrid_device_mesh`.
    """
    devices = list(jax.devices() if devices is None else devices)
    spec = spec.resolve(len(devices))
    shape = tuple(spec.size(a) for a in AXES)
    if spec.dcn and jax.process_count() > 1:
        from jax.experimental import mesh_utils

        dcn_shape = tuple(spec.dcn.get(a, 1) for a in AXES)
        for axis, size, across in zip(AXES, shape, dcn_shape):
            if size % across:
                raise ValueError(f"mesh axis {axis!r}={size} does not divide into dcn={across} host slices")
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape))
        # Devices on one slice (CPU and GPU hosts give all slice_index 0, or none): the processes are the hosts
        by_process = len({getattr(d, "slice_index", None) for d in devices}) == 1
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices=devices,
                                                    process_is_granule=by_process)
    elif len(devices) == len(jax.devices()) and devices[0] in jax.devices():  # not a compile-only target's devices
        # (jaxpar.core.target: those are laid out as listed, hosts outermost)
        grid = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES)).devices
    else:
        grid = np.asarray(devices).reshape(shape)
    return nesting_order(Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES)))


def adopt(mesh: Mesh, axis_names: dict[str, str] | None = None) -> Mesh:
    """A user's jax Mesh on jaxpar's axes: the same devices, axes renamed by `axis_names` (e.g. model -> tensor).

    Axes it lacks are added with size 1; every axis becomes Auto (jaxpar
    writes its own shard_maps and places the rest from annotations).
    """
    rename = dict(axis_names or {})
    names = [rename.get(n, n) for n in mesh.axis_names]
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {unknown} are not jaxpar's ({', '.join(AXES)}); map them onto jaxpar's axes, e.g. "
            f"Plan.create(mesh, axis_names={{{unknown[0]!r}: 'tensor'}})"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"axis_names={rename} maps two mesh axes {tuple(mesh.axis_names)} onto one jaxpar axis")
    if tuple(names) == tuple(mesh.axis_names) and set(names) == set(AXES) and \
            all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    missing = [a for a in AXES if a not in names]
    grid = mesh.devices.reshape(mesh.devices.shape + (1,) * len(missing))
    return Mesh(grid, (*names, *missing), axis_types=(AxisType.Auto,) * len(AXES))


def nesting_order(mesh: Mesh, outer: tuple[str, ...] = ()) -> Mesh:
    """The same devices with `outer` and the axes of size 1 first, the others after in `AXES` order.

    See the module doc. A mesh whose axes jaxpar does not know is returned as
    it is (rules.resolve_spec names the unknown axis).
    """
    if set(mesh.axis_names) != set(AXES):
        return mesh
    shape = mesh_shape(mesh)
    order = sorted(AXES, key=lambda a: (a not in outer and shape[a] > 1, AXES.index(a)))
    if tuple(order) == tuple(mesh.axis_names):
        return mesh
    grid = np.transpose(mesh.devices, [mesh.axis_names.index(a) for a in order])
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return Mesh(grid, tuple(order), axis_types=tuple(types[a] for a in order))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Axis sizes by name, in `AXES` order whatever the mesh's own order."""
    shape = dict(zip(mesh.axis_names, mesh.devices.shape))
    return {a: shape[a] for a in AXES} if set(shape) == set(AXES) else shape
