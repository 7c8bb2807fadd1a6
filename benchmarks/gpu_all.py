"""All GPU benchmarks in one process (the 48B model is built once): kernels, decode, prefill."""

from __future__ import annotations

import gpu_decode
import gpu_kernels
import gpu_prefill
from gpu_common import MODEL_48B, ceilings

from hyserve.models.loader import load_model

if __name__ == "__main__":
    ceil = ceilings()
    print(ceil, flush=True)
    gpu_kernels.main(ceil)
    model = load_model(MODEL_48B, device="cuda")
    gpu_prefill.main(model, ceil)
    gpu_decode.main(model, ceil)
