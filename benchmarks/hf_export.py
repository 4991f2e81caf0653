"""`jaxpar export --format hf` of a Llama of a chosen size: peak host memory against the model and its largest tensor.

Writes a random bfloat16 Hugging Face checkpoint (`hf_import.write_random_hf`),
imports it (`jaxpar import-hf`: an fp32 export directory read by TensorStore as
a training checkpoint is), then exports it back as fp32 safetensors in a child
process (or `--processes` of them under `jaxpar launch`) whose peak resident
memory is read from the kernel (`os.wait4`: that child and every process it
waited for). Export writes tensor by tensor, so the peak should follow the
largest tensor, not the model. Prints JSON. Usage:

    python benchmarks/hf_export.py --layers 3 --work /tmp/hfx   # a 1.25 GB (fp32) model
    python benchmarks/hf_export.py --layers 8 --work /tmp/hfx   # 2.47 GB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_import import write_random_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", help="the jaxpar model whose shape the checkpoint takes")
    parser.add_argument("--layers", type=int, default=3, help="its layer count (the model's size)")
    parser.add_argument("--processes", type=int, default=1, help="processes exporting together (jaxpar launch -n)")
    parser.add_argument("--work", default="/tmp/jaxpar-hf-export", help="scratch directory (removed first)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.interop import hf
    from jaxpar.models import model_config

    cfg = model_config(args.model, {"n_layers": args.layers})
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    write_random_hf(work / "hf", cfg)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cli = [sys.executable, "-m", "jaxpar.cli"]
    imported, _, _ = run_peak([*cli, "import-hf", str(work / "hf"), "--out", str(work / "jaxpar")], env)
    launch = [] if args.processes == 1 else ["launch", "-n", str(args.processes), "--devices-per-process",
                                             str(8 // args.processes)]
    seconds, peak, _ = run_peak([*cli, *launch, "export", "--checkpoint-dir", str(work / "jaxpar"), "--out",
                                 str(work / "out"), "--format", "hf", "--dtype", "float32"], env)
    shapes = hf.expected_hf_shapes(cfg)
    model_bytes = sum(math.prod(s) for s in shapes.values()) * 4
    largest = max(math.prod(s) for s in shapes.values()) * 4
    written = sum(p.stat().st_size for p in (work / "out").glob("*.safetensors"))
    print(json.dumps({
        "model": args.model, "layers": args.layers, "processes": args.processes,
        "model_bytes_fp32": model_bytes, "largest_tensor_bytes": largest, "written_bytes": written,
        "export_s": round(seconds, 2), "peak_rss_bytes": peak, "peak_rss_gib": round(peak / 2**30, 3),
        "peak_over_model": round(peak / model_bytes, 3),
        "peak_minus_largest_gib": round((peak - largest) / 2**30, 3),
        "import_s": round(imported, 2),
    }))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def run_peak(command: list[str], env: dict) -> tuple[float, int, str]:
    """(seconds, peak resident bytes of the command and every process it waited for, stdout); exits on failure."""
    began = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if status:
        sys.exit(f"{' '.join(command[3:5])} failed:\n{stderr[-3000:]}")
    return time.perf_counter() - began, usage.ru_maxrss * 1024, stdout


if __name__ == "__main__":
    main()
