"""Loading a 48B-shaped checkpoint from disk through the product entry point, on one GPU.

    python benchmarks/gpu_load.py                       # write, load from disk, start the full preset
    python benchmarks/gpu_load.py --layers 8 --modes write,disk --load-formats safetensors,fastsafetensors
    python benchmarks/gpu_load.py --modes dummy         # only: the 27-layer preset with --load-format dummy
    python benchmarks/gpu_load.py --preset kimi-linear-tiny --layers 3 --device cpu --shard-gb 0.0001 --no-append
                                                        # a dry run on the CPU

Modes, each in a fresh process (so every number is that process's own):
  write  the kimi-linear-48b-a3b preset cut to --layers layers (12 of 27: about 42 GB of bf16) as a
         sharded HF-format directory (5 GB shards), from random weights drawn on the GPU; the page cache
         of the files is dropped afterwards (posix_fadvise), so the load reads the disk;
  disk   `LLM(<dir>, load_format=...)` until ready, for each --load-formats entry (fastsafetensors only
         where the package is installed): load time and GB/s, peak host memory while loading against the
         bound (1.5x the largest shard + 2 GiB), device memory against the weight bytes, start-up split;
  dummy  `LLM("kimi-linear-48b-a3b", load_format="dummy")` at full depth until ready.
The table is filed in docs/BENCHMARKS.md (newest first) (and $OUT/gpu_load.md when $OUT is set); --no-append prints it
only. Progress lines carry the seconds since the start. The directory is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_step_cost import code_state  # noqa: E402

GB, GIB = 1e9, 1 << 30
_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[gpu_load {time.monotonic() - _T0:6.1f} s] {msg}", flush=True)


def cut_config(preset: str, layers: int) -> dict:
    """The preset's config.json with its first `layers` layers (its layer kinds kept)."""
    from hyserve.models.presets import preset_config

    raw = preset_config(preset)
    lin = raw["linear_attn_config"]
    raw["num_hidden_layers"] = layers
    lin["kda_layers"] = [i for i in lin["kda_layers"] if i <= layers]
    lin["full_attn_layers"] = [i for i in lin["full_attn_layers"] if i <= layers]
    return raw


def checkpoint_bytes(raw: dict) -> int:
    """Bytes the directory will hold (bf16, the fp32 parameters in fp32), from a meta-device build."""
    import torch

    from hyserve.models.config import parse_config
    from hyserve.models.loader import build_model

    return sum(p.numel() * p.element_size() for p in build_model(parse_config(raw), torch.bfloat16, "meta").parameters())


def fitting_layers(preset: str, wanted: int, directory: Path, reserve: float = 6 * GIB) -> int:
    free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    layers = wanted
    while layers > 2 and checkpoint_bytes(cut_config(preset, layers)) > free - reserve:
        layers -= 1
    if layers != wanted:
        say(f"{free / GB:.1f} GB free: {layers} layers fit (asked for {wanted})")
    return layers


def drop_page_cache(files: list[str]) -> bool:
    """Evict the files from the page cache, so the next load reads the disk; False where the OS refuses."""
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    except (OSError, AttributeError) as e:  # AttributeError: no posix_fadvise on this platform
        say(f"could not drop the page cache ({e}): the load may read from memory")
        return False


def shard_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.glob("model*.safetensors"))


# ---- the child processes ------------------------------------------------------------------------


def child_write(directory: str, preset: str, layers: int, shard_gb: float, device: str) -> dict:
    import torch

    from hyserve.models.checkpoint_writer import write_checkpoint
    from hyserve.models.loader import load_model

    raw = cut_config(preset, layers)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f)
    model = load_model(directory, load_format="dummy", device=device)  # a large model draws on the GPU
    say(f"model of {layers} layers on {device}: {model.load_report.weight_bytes / GB:.1f} GB; writing")
    start = time.perf_counter()
    files = write_checkpoint(model, raw, directory, torch.bfloat16, int(shard_gb * GB), progress=say)
    seconds = time.perf_counter() - start
    drop_page_cache(files)
    return {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "seconds": seconds}


def child_load(model: str, load_format: str, preset: str, device: str, warmup: str = "default") -> dict:
    from hyserve import LLM
    from hyserve.models import host_memory
    from hyserve.startup import since_process_start

    # the preset's tokenizer (its family's byte tokenizer): the directory holds weights and config only
    extra = {"warmup": False} if warmup == "off" else {}
    llm = LLM(model, load_format=load_format, tokenizer=preset, device=device, **extra)
    ready = since_process_start()
    engine = llm.engine
    return {"load": engine.model.load_report.__dict__, "phases": engine.startup.phases, "ready": ready,
            "vmhwm": host_memory.peak_rss_bytes(), "layers": engine.model_config.num_hidden_layers}


def run_child(args: list[str], timeout: float) -> dict | None:
    """Run this script's child mode, echoing its output; its RESULT line, or None when it failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    result, deadline = None, time.monotonic() + timeout
    try:
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            else:
                print("    " + line.rstrip(), flush=True)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(args, timeout)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        say(f"{' '.join(args[:2])}: stopped after {timeout:.0f} s")
        return None
    if proc.returncode != 0:
        say(f"{' '.join(args[:2])}: exited with {proc.returncode}")
        return None
    return result


# ---- the table ------------------------------------------------------------------------------------

HEADER = ["| run | load format | weights | files (largest) | load | rate | host peak while loading | bound | "
          "process peak RSS | device allocated / weights | device peak | ready after process start |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def row(name: str, r: dict) -> str:
    from hyserve.models.load_report import LoadReport
    from hyserve.startup import describe_startup

    rep = LoadReport(**r["load"])
    files = f"{rep.num_files} ({rep.largest_file_bytes / GB:.2f} GB)" if rep.num_files else "none"
    if rep.host_increase is None:
        host = bound = "n/a"
    else:
        host = f"+{rep.host_increase / GIB:.2f} GiB"
        within = "within" if rep.host_increase <= rep.host_bound else "OVER"
        bound = f"{rep.host_bound / GIB:.2f} GiB ({within})" if rep.num_files else "n/a (no files)"
    dev = f"{rep.device_allocated / GB:.2f} / {rep.weight_bytes / GB:.2f} GB" if rep.device_allocated else "n/a"
    peak = f"{rep.device_peak / GB:.2f} GB" if rep.device_peak else "n/a"
    rate = f"{rep.gbps:.2f} GB/s" if rep.num_files else "-"
    ready = describe_startup(r["ready"], r["phases"]).removeprefix("ready ").replace(" after process start", "")
    return (f"| {name} | {rep.load_format} | {rep.weight_bytes / GB:.2f} GB | {files} | {rep.seconds:.1f} s | {rate} | "
            f"{host} over {rep.host_rss_before / GIB:.2f} GiB | {bound} | {r['vmhwm'] / GIB:.2f} GiB | {dev} | {peak} | "
            f"{ready} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="kimi-linear-48b-a3b", help="the shape to write and to start as dummy")
    p.add_argument("--layers", type=int, default=12, help="layers of the 27 to write (fewer when the disk is short)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: /tmp/hyserve-48b-<layers>l)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size, as save_pretrained's default")
    p.add_argument("--modes", default="write,disk,dummy", help="of write, disk, dummy")
    p.add_argument("--load-formats", default="safetensors", help="for the disk mode: safetensors,fastsafetensors")
    p.add_argument("--timeout", type=float, default=420, help="seconds per child process")
    p.add_argument("--keep", action="store_true", help="keep the directory afterwards")
    p.add_argument("--no-warmup", action="store_true",
                   help="start the engines as `hyserve serve --no-warmup` does (the load is the same; ready sooner)")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    p.add_argument("--code-state", default=None, help="for the report (default: HYSERVE_CODE_STATE, else git rev-parse here)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    layers = args.layers
    directory = Path(args.dir or f"/tmp/hyserve-{args.preset}-{layers}l")
    notes, rows, cold = [], [], True
    warmup = "off" if args.no_warmup else "default"
    if "write" in modes:
        layers = fitting_layers(args.preset, layers, directory)
        say(f"writing {layers} layers ({checkpoint_bytes(cut_config(args.preset, layers)) / GB:.1f} GB) to {directory}")
        w = run_child(["_write", str(directory), args.preset, str(layers), str(args.shard_gb), args.device], args.timeout)
        if w is None:
            return 1
        notes.append(f"Written: {w['files']} shards, {w['bytes'] / GB:.2f} GB in {w['seconds']:.1f} s "
                     f"({w['bytes'] / GB / w['seconds']:.2f} GB/s, GPU to disk).")
    if "disk" in modes:
        import importlib.util

        for fmt in args.load_formats.split(","):
            if fmt == "fastsafetensors" and importlib.util.find_spec("fastsafetensors") is None:
                rows.append(f"| {layers}-layer directory | fastsafetensors | not installed (pip install fastsafetensors) |")
                continue
            cold = drop_page_cache(shard_files(directory)) and cold
            say(f"LLM({directory}, load_format={fmt!r}) until ready")
            r = run_child(["_load", str(directory), fmt, args.preset, args.device, warmup], args.timeout)
            rows.append(row(f"{r['layers']}-layer directory", r) if r else f"| {layers}-layer directory | {fmt} | failed |")
            say(rows[-1])
    if "dummy" in modes:
        say(f"LLM({args.preset!r}, load_format='dummy') until ready")
        r = run_child(["_load", args.preset, "dummy", args.preset, args.device, warmup], args.timeout)
        rows.append(row(f"{args.preset} ({r['layers']} layers)", r) if r else f"| {args.preset} | dummy | failed |")
        say(rows[-1])
    if directory.exists() and not args.keep and "disk" in modes:
        shutil.rmtree(directory)
    notes += ["Through `LLM(...)` in a fresh process per row, engine defaults (what `hyserve serve` builds"
              + (", without the warm-up, as `--no-warmup`" if args.no_warmup else "") + "). Host "
              "peak while loading: the loader's own reading, /proc/self VmHWM reset at the load's start, over the "
              "resident size before it; bound 1.5x the largest shard + 2 GiB. Process peak RSS: the whole process's "
              "VmHWM at ready (CUDA context and libraries included). Device: torch's allocated bytes after loading "
              "and their peak during it. "
              + ("Page cache of the shards dropped before each load (posix_fadvise): reads from the disk."
                 if cold else "The page cache could not be dropped: the loads may have read from memory."),
              f"Code state: {args.code_state or code_state()}."]
    from gpu_common import machine, report

    command = " ".join(["python benchmarks/gpu_load.py", *(sys.argv[1:] if argv is None else argv)])
    title = f"Loading {args.preset} from disk and as dummy weights"
    date = datetime.date.today().isoformat()
    if args.no_append:
        where = machine() if args.device == "cuda" else f"CPU ({args.device})"
        print("\n".join([f"\n## {title} ({date})", "", f"Machine: {where}. Command: `{command}`.", "", *HEADER, *rows,
                         "", *notes]))
    else:
        report(title, command, HEADER + rows, notes, "gpu_load.md", date=date)
    return 0 if rows and all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_write":
        a = sys.argv[2:]
        print("RESULT " + json.dumps(child_write(a[0], a[1], int(a[2]), float(a[3]), a[4])), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "_load":
        print("RESULT " + json.dumps(child_load(*sys.argv[2:7])), flush=True)
    else:
        sys.exit(main())
