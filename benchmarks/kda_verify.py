# ruff: noqa: B023  (timing lambdas run inside the loop that binds them)
"""KDA verify kernels against the decode kernels on the 48B head shape (32 heads x 128, one layer): what
one state slot per token costs (T state stores instead of one, the source windows staged in torch).

    python benchmarks/kda_verify.py            # prints a markdown table; CUDA only

Per (batch, tokens per sequence T = 1 + drafts): graph-replay time of `kda_decode_multi` (state written
once) and `kda_verify_multi` (state written after every token), and the verify kernel's state bytes as
a fraction of copy bandwidth.
"""

from __future__ import annotations

import sys

import torch
from gpu_common import ceilings, time_graph_per_call_ms

H, K, W = 32, 128, 4
P = H * K


def case(n: int, t: int, gen: torch.Generator) -> dict:
    dev, bf = "cuda", torch.bfloat16
    slots = n * t + 1
    return dict(
        x=torch.randn(n * t, 3 * P, device=dev, generator=gen).to(bf),
        f=torch.randn(n * t, P, device=dev, generator=gen).to(bf),
        b=torch.randn(n * t, H, device=dev, generator=gen).to(bf),
        gate=torch.randn(n * t, P, device=dev, generator=gen).to(bf),
        cw=torch.randn(3 * P, W, device=dev, generator=gen) * 0.3,
        conv=torch.randn(slots, 3 * P, W - 1, device=dev, generator=gen).to(bf),
        rec=torch.randn(slots, H, K, K, device=dev, generator=gen) * 0.1,
        alog=torch.zeros(H, device=dev), dtb=torch.zeros(P, device=dev), onw=torch.ones(K, device=dev),
        table=torch.arange(n * t, device=dev).view(n, t), src=torch.zeros(n, dtype=torch.long, device=dev),
        slots=torch.arange(n, device=dev) * t, fresh=torch.zeros(n, dtype=torch.bool, device=dev),
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from hyserve.ops.kda_decode import kda_decode_multi
    from hyserve.ops.kda_verify_triton import kda_verify_multi

    copy = ceilings()["copy_tbs"]
    gen = torch.Generator("cuda").manual_seed(0)
    rows = ["| batch | T | decode_multi µs | verify_multi µs | ratio | verify state bytes, % of copy |",
            "| --- | --- | --- | --- | --- | --- |"]
    for n in (1, 8, 32):
        for t in (1, 2, 4, 8):
            c = case(n, t, gen)
            args = (c["x"], c["f"], c["b"], c["gate"], c["cw"], c["conv"], c["rec"], c["alog"], c["dtb"], c["onw"])
            dec = time_graph_per_call_ms(lambda: kda_decode_multi(*args, c["slots"], c["fresh"], K**-0.5, 1e-5, -5.0, t)) * 1e3
            ver = time_graph_per_call_ms(lambda: kda_verify_multi(*args, c["table"], c["src"], K**-0.5, 1e-5, -5.0, t)) * 1e3
            state_bytes = n * H * K * K * 4 * (1 + t)  # one read, t writes
            pct = 100 * state_bytes / (ver * 1e-6) / (copy * 1e12)
            rows.append(f"| {n} | {t} | {dec:.1f} | {ver:.1f} | {ver / dec:.2f} | {pct:.0f}% |")
    print("\n".join(rows))
    print(f"\ncopy bandwidth measured in this run: {copy:.2f} TB/s (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
