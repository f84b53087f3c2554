"""tools/dev/gpu_check.sh's bookkeeping: the device, versions and commit first; then after every step its record,
and OUT/summary.json rebuilt from all records with each step's figures read from its outputs (its JSON, junit XML
or log). A figure a step did not print is absent: nothing here estimates or fills in.

    python tools/dev/gpu_summary.py OUT start --dry 0 --budget 480
    python tools/dev/gpu_summary.py OUT record NAME STATUS [--seconds S --rc RC --limit S --command TEXT] [--note TEXT]
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTCOMES = ("passed", "failed", "error", "skipped")
LOG_WORDS = {"passed": "PASSED", "failed": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}  # pytest -v


def run(command: list[str]) -> str | None:
    """The command's stripped stdout, or None where it is missing or fails."""
    if shutil.which(command[0]) is None:
        return None
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    return result.stdout.strip() if result.returncode == 0 else None


def commit() -> dict:
    """The checkout's commit: `git rev-parse HEAD` where this is a git checkout, else the COMMIT variable."""
    sha = run(["git", "rev-parse", "HEAD"])
    if sha:
        return {"commit": sha, "commit_from": "git", "dirty": bool(run(["git", "status", "--porcelain"]))}
    return {"commit": os.environ.get("COMMIT"), "commit_from": "COMMIT variable" if "COMMIT" in os.environ else None}


def versions() -> dict:
    """Python, torch (and its CUDA), triton, transformers; the device torch sees."""
    import torch

    from megalite.kernels.gemm import mixed_gemm
    from megalite.model.context_parallel import ring_blocks

    found = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for module in ("triton", "transformers", "numpy"):
        try:
            found[module] = __import__(module).__version__
        except ImportError:
            found[module] = None
    cuda = torch.cuda.is_available()
    found["device"] = torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()}, no CUDA)"
    # how the linears' fused weight grads (tensor_parallel/grad_accumulation.py) reach the fp32 main grads here,
    # and how the CP ring's 16-bit blocks run (model/context_parallel.py)
    found["mixed_gemm"] = mixed_gemm(torch.device("cuda")) if cuda else None
    found["cp_ring_blocks"] = ring_blocks(torch.device("cuda")) if cuda else None
    found["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return found


def start(out: Path, dry: bool, budget: int) -> None:
    """OUT/meta.json, printed too: written before any step, so that a call cut short still says where it ran."""
    meta = {**commit(), **versions(), "dry": dry, "budget_s": budget}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


# ------------------------------------------------------------------------------------------- each step's figures
def pytest_counts(out: Path, name: str) -> dict:
    """Outcome counts from NAME.xml (junit); a run cut short writes none, so then its -v log's outcome words.
    With conftest's count of the gpu-marked tests that ran."""
    log, xml = read(out, name), out / f"{name}.xml"
    if xml.exists():
        cases = [(f"{case.get('classname')}::{case.get('name')}", junit_outcome(case))
                 for case in ElementTree.parse(xml).getroot().iter("testcase")]
        counts = {"from": "junit xml", **{word: sum(1 for _, o in cases if o == word) for word in OUTCOMES}}
        counts["failed_tests"] = [test for test, outcome in cases if outcome in ("failed", "error")][:30]
    else:  # -v lines: "tests/x.py::name PASSED [ 5%]" (a reason may follow the word), or under xdist
        # "[gw0] [ 5%] PASSED tests/x.py::name"
        words = [a or b for a, b in re.findall(r"::\S+ ([A-Z]+)\b|\] ([A-Z]+) \S+::", log)]
        counts = {"from": "the -v log (no junit xml: the run was cut short)",
                  **{word: words.count(LOG_WORDS[word]) for word in OUTCOMES}}
    gpu = re.search(r"gpu-marked tests: (\d+) ran, (\d+) passed, (\d+) failed, (\d+) skipped", log)
    if gpu:
        counts["gpu_marked"] = dict(zip(("ran", "passed", "failed", "skipped"), map(int, gpu.groups())))
    return counts


def junit_outcome(case) -> str:
    """One of OUTCOMES for a junit <testcase>."""
    return next((word for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                 if case.find(tag) is not None), "passed")


LOG_FIELDS = {  # pretrain_gpt.py's iteration line (megalite/run/logger.py)
    "ms_per_iteration": r"elapsed time per iteration \(ms\): ([\d.]+)",
    "tokens_per_s": r"tokens/s: ([\d.]+)",
    "tflops_per_device": r"TFLOP/s per device: ([\d.]+)",
    "mfu_percent": r"MFU: ([\d.]+)%",
    "lm_loss": r"lm loss: ([-+\d.Ee]+)",
}


def last_iteration(out: Path, name: str) -> dict:
    """The last iteration line of pretrain_gpt.py's log: its iteration and LOG_FIELDS."""
    lines = [line for line in read(out, name).splitlines() if re.match(r"\s*iteration\s+\d+/", line)]
    if not lines:
        return {}
    figures = {"iteration": re.match(r"\s*iteration\s+(\d+/\s*\d+)", lines[-1]).group(1).replace(" ", "")}
    for field, pattern in LOG_FIELDS.items():
        found = re.search(pattern, lines[-1])
        if found:
            figures[field] = float(found.group(1))
    return figures


def bench(out: Path, name: str) -> dict:
    """train_throughput.py's --json: each variant's median tokens/s, megalite's best mode and MFU, the ratios."""
    summary = read_json(out, name)
    if summary is None:
        return {}
    return {"best": summary["best"], "megalite_mfu": summary["mfu"], "tokens_per_s": summary["medians"],
            "megalite_over": summary["peers"]}


def kernels(out: Path, name: str) -> dict:
    """kernels.py's --json rows, and megalite's Triton time as a speed-up over eager and compile per kernel."""
    table = read_json(out, name)
    if table is None:
        return {}
    times = {}
    for row in table["kernels"]:
        times.setdefault(f"{row['kernel']} {row['size']}", {})[row["impl"]] = row["gpu_ms"]
    speedups = {key: {f"triton_vs_{impl}": ms[impl] / ms["triton"] for impl in ("eager", "compile") if impl in ms}
                for key, ms in times.items() if "triton" in ms}
    return {**table, "triton_speedups": speedups}


def profile(out: Path, name: str) -> dict:
    """The profile tables as NAME.txt; in the summary, megalite's top 10 rows."""
    summary = read_json(out, name)
    if summary is None or "profiles" not in summary:
        return {}
    tables = summary["profiles"]
    (out / f"{name}.txt").write_text("".join(f"{variant}, by {p['sort_by']}:\n{p['table']}\n" for variant, p in
                                             tables.items()))
    mine = tables[summary["best"]["megalite"]]
    return {"tables": f"{name}.txt", "sort_by": mine["sort_by"], "megalite_top10": mine["top"][:10]}


def cp_attention(out: Path, name: str) -> dict:
    """cp_attention.py's log: whether every rank's bytes equalled the closed form, and each timed layout's ms per
    forward + backward and its speed against one-device SDPA (a ring-blocks row's: against SDPA / CP), absent
    where the bench printed no time."""
    log = read(out, name)
    figures = {"bytes_equal_closed_form": "PASS: every rank's bytes equal" in log} if "every rank's bytes" in log else {}
    timed = re.findall(r"^(one-device SDPA|CP \d+ \S+|ring CP \d+ \S+)\s+([\d.]+)\s+([\d.]+)$", log,
                       flags=re.MULTILINE)
    if timed:
        figures["ms_per_iteration"] = {layout: float(ms) for layout, ms, _ in timed}
        figures["vs_one_device"] = {layout: float(ratio) for layout, _, ratio in timed}
    return figures


FIGURES = {"gpu_tests": pytest_counts, "bench_1b": bench, "pretrain_eager": last_iteration,
           "pretrain_compile": last_iteration, "kernels": kernels, "profile_1b": profile, "moe_loop": last_iteration,
           "moe_grouped": last_iteration, "cp_attention": cp_attention, "pretrain_unfused": last_iteration,
           "suite": pytest_counts}


def read(out: Path, name: str) -> str:
    path = out / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def read_json(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------------------------------------------- summary
def record(out: Path, args) -> None:
    """One step's record appended to OUT/steps.jsonl, then the summary rebuilt."""
    entry = {"step": args.name, "status": args.status, "seconds": args.seconds, "rc": args.rc, "limit_s": args.limit,
             "command": args.command, "note": args.note}
    with open(out / "steps.jsonl", "a") as file:
        file.write(json.dumps({key: value for key, value in entry.items() if value is not None}) + "\n")
    write_summary(out)


def write_summary(out: Path) -> None:
    """OUT/summary.json: meta.json's fields, then every recorded step with its figures."""
    meta = json.loads((out / "meta.json").read_text())
    steps = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        entry = json.loads(line)
        name = entry.pop("step")
        if name in FIGURES and entry["status"] != "skipped":
            try:
                entry["figures"] = FIGURES[name](out, name)
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, ElementTree.ParseError) as error:
                # a half-written or odd output: said, not guessed around
                entry["figures_error"] = f"{type(error).__name__}: {error}"
        steps[name] = entry
    (out / "summary.json").write_text(json.dumps({**meta, "steps": steps}, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    commands = parser.add_subparsers(dest="what", required=True)
    first = commands.add_parser("start")
    first.add_argument("--dry", type=int, choices=(0, 1), default=0)
    first.add_argument("--budget", type=int, required=True)
    step = commands.add_parser("record")
    step.add_argument("name")
    step.add_argument("status", choices=("ok", "failed", "timed out", "skipped"))
    step.add_argument("--seconds", type=int)
    step.add_argument("--rc", type=int)
    step.add_argument("--limit", type=int)
    step.add_argument("--command")
    step.add_argument("--note")
    args = parser.parse_args(argv)
    if args.what == "start":
        start(args.out, bool(args.dry), args.budget)
    else:
        record(args.out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
