"""A source checkout imports as it is: jaxpar.models and jaxpar.meshes resolve to the top-level folders."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_checkout_imports_without_the_installed_package():
    """`python -S` skips site's .pth files (so no editable-install finder); the checkout is the working directory."""
    code = ("import jaxpar, jaxpar.models, jaxpar.meshes; from jaxpar.core.mesh import available_presets; "
            "print(jaxpar.models.__file__, sorted(available_presets())[0])")
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "models" / "__init__.py"), "3d-2x2x2"]
