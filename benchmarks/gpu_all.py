"""All GPU benchmarks in one process (the 48B model is built once): kernels, decode, prefill."""

from __future__ import annotations

import gpu_decode
import gpu_kernels
import gpu_prefill
from gpu_common import ceilings, load_48b

if __name__ == "__main__":
    ceil = ceilings()
    print(ceil, flush=True)
    gpu_kernels.main(ceil)
    model = load_48b()
    gpu_prefill.main(model, ceil)
    gpu_decode.main(model, ceil)
