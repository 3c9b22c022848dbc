"""How long `fsdp-sim sweep` takes (points, wall, CPU) on grids over shipped scenarios that are not plain FSDP2:
LoRA and QLoRA, plain single-GPU QLoRA, FSDP1 QLoRA with offload, gradient accumulation (a folded step),
HSDP without sync, a Mixture of Experts from a Hugging Face config, tensor parallelism; and `recommend` on
the QLoRA 70B fine-tune. `bench_sweep.py` times plain llama3-8b grids; a user's grid is often one of these.

Each is the command a user runs, in a fresh process on 2 workers, best wall of ROUNDS and its CPU (the
command's and its workers'). With COMMIT, the same commands from that commit (exported with `git archive`,
run from its folder) alternate with this checkout's, and the outputs are compared byte for byte.
Run: python benchmarks/bench_grids.py [ROUNDS=2] [COMMIT]
"""

from __future__ import annotations

import filecmp
import io
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH_SEQ = ["--set", "training.micro_batch=1,2", "--set", "training.seq_len=1024,2048,4096",
             "--set", "training.activation_checkpointing=none,full"]
SWEEPS = [  # (scenario, more axes): every one varies micro-batch, sequence and checkpointing
    ("llama2-70b-8xa100-80gb-qlora", ["--set", "fsdp.backward_prefetch=true,false", "--set", "hardware.nodes=1,2"]),
    ("llama2-70b-8xa100-80gb-lora", ["--set", "fsdp.backward_prefetch=true,false"]),
    ("llama2-7b-1xrtx-4090-qlora", []),
    ("llama2-70b-2xrtx-4090-fsdp1-qlora-offload", []),
    ("llama3-8b-8xh200-accumulation-keep-unsharded", ["--set", "fsdp.backward_prefetch=true,false"]),
    ("llama2-7b-16xh100-fsdp1-hsdp-no-sync", []),
    ("mixtral-8x7b-16xh100", ["--set", "fsdp.backward_prefetch=true,false"]),
    ("llama3-70b-64xh100-tp8", ["--set", "fsdp.backward_prefetch=true,false"]),
]
RECOMMEND = "llama2-70b-8xa100-80gb-qlora"
CLI = "import sys; from fsdp_sim.cli import main; sys.exit(main(sys.argv[1:]))"


def timed(folder: Path, argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (the command's and its workers') of the CLI run from `folder`'s package."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CLI, *argv], cwd=folder, check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    commit = sys.argv[2] if len(sys.argv) > 2 else None
    with tempfile.TemporaryDirectory(prefix="fsdp-grids-") as tmp:
        tmp = Path(tmp)
        folders = {"this checkout": ROOT}
        if commit:
            archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
            (tmp / "commit").mkdir()
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp / "commit", filter="data")
            folders = {commit: tmp / "commit", "this checkout": ROOT}
        jobs = [(f"sweep {name}", ["sweep", str(ROOT / "scenarios" / f"{name}.yaml"), *BATCH_SEQ, *axes, "--jobs", "2",
                                   "-q", "-o"]) for name, axes in SWEEPS]
        jobs.append((f"recommend {RECOMMEND}", ["recommend", str(ROOT / "scenarios" / f"{RECOMMEND}.yaml"), "--jobs", "2",
                                                "--json"]))
        print(f"{'command':<58}{'points':>7}" + "".join(f"{label[:14]:>16}" for label in folders)
              + "   (best wall s / its CPU s)")
        for title, argv in jobs:
            best = {}
            for _ in range(rounds):
                for label, folder in folders.items():
                    out = tmp / f"{label.replace(' ', '_')}.out"
                    wall, cpu = timed(folder, argv + [str(out)])
                    if wall < best.get(label, (float("inf"),))[0]:
                        best[label] = (wall, cpu)
            same = ""
            if commit:
                outs = [tmp / f"{label.replace(' ', '_')}.out" for label in folders]
                same = "  same output" if all(o.exists() for o in outs) and filecmp.cmp(*outs, shallow=False) else "  OUTPUTS DIFFER"
            mine = tmp / "this_checkout.out"
            points = len(mine.read_text().splitlines()) - 1 if argv[0] == "sweep" and mine.exists() else ""
            print(f"{title:<58}{points:>7}" + "".join(f"{best[label][0]:>8.2f} / {best[label][1]:<5.2f}"
                                                     for label in folders) + same)


if __name__ == "__main__":
    main()
