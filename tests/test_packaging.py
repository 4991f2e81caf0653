"""The wheel ships every package of the source tree: `pip install .` (CI's, a user's) is not an editable install,
so a package missing from pyproject's list is missing for every user, while tests run from the checkout pass."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_under_jaxpar_is_in_pyprojects_list():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {"jaxpar." + ".".join(init.parent.relative_to(ROOT / "jaxpar").parts)
               for init in (ROOT / "jaxpar").rglob("__init__.py") if init.parent != ROOT / "jaxpar"}
    missing = sorted(on_disk - listed)
    assert not missing, f"packages not in pyproject.toml's [tool.setuptools] packages (a wheel leaves them out): {missing}"
    assert {"jaxpar", "jaxpar.models", "jaxpar.meshes"} <= listed
