"""`jaxpar import-hf` on a random Hugging Face checkpoint of a given jaxpar config's shape: time and peak host memory.

Writes a random bfloat16 Llama (one safetensors file per layer and an index, as
published checkpoints are sharded) without torch or transformers, then runs the
import as a child process and prints JSON: parameters, source bytes, seconds,
peak resident memory of the import. Usage:

    python benchmarks/hf_import.py --model 1b --work /tmp/hf1b
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def write_random_hf(directory: Path, cfg, seed: int = 0) -> int:
    """A random bf16 Llama of `cfg`'s shape as sharded safetensors + config.json; returns its bytes."""
    import jax
    import numpy as np

    from jaxpar.interop import hf, hf_config, hf_write, safetensors_reader
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    (directory / hf_config.HF_CONFIG).write_text(json.dumps(hf_config.config_to_hf(cfg, "bfloat16"), indent=2))
    shapes = hf.expected_hf_shapes(cfg)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, []).append(name)
    weight_map, total = {}, 0
    bf16 = np.dtype(jax.numpy.bfloat16)
    for i, (layer, names) in enumerate(groups.items()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            values = rng.standard_normal(shapes[name], dtype=np.float32) * 0.02
            tensors[name] = 1.0 + values if name.endswith("norm.weight") else values
        hf_write._save(tensors, bf16, directory / file, {"format": "pt"})
        total += sum(a.size * 2 for a in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / safetensors_reader.INDEX_FILE).write_text(json.dumps(index))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b", help="a jaxpar model name whose shape the checkpoint takes")
    parser.add_argument("--work", default="/tmp/jaxpar-hf-import", help="scratch directory (removed first)")
    parser.add_argument("--devices", type=int, default=8, help="host devices the import splits the weights over")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpar.models import model_config

    cfg = model_config(args.model)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    began = time.perf_counter()
    source_bytes = write_random_hf(work / "hf", cfg)
    written = time.perf_counter() - began
    command = [sys.executable, "-m", "jaxpar.cli", "import-hf", str(work / "hf"), "--out", str(work / "jaxpar"),
               "--devices", str(args.devices), "--json"]
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if result.returncode:
        sys.exit(result.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps({
        "model": args.model, "params": imported["params"], "source_bytes_bf16": source_bytes,
        "imported_bytes_fp32": imported["params"] * 4, "import_s": round(seconds, 2),
        "import_s_inside": imported["seconds"], "peak_rss_bytes": peak, "peak_rss_gib": round(peak / 2**30, 2),
        "write_random_checkpoint_s": round(written, 2), "devices": args.devices,
    }))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
