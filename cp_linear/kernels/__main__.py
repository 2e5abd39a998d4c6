"""Compile every GDP kernel ahead of time, without a GPU.

    python -m cp_linear.kernels --compile --arch sm_90a [--ptxas] [--only TEXT] [--jobs N]

Lists each kernel config with its compile time; ``--ptxas`` also keeps the PTX and reports
registers, stack frame and spills from ``ptxas -arch=<arch> -v`` (when ptxas is on PATH).
Exits 1 if any kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cp_linear.kernels.configs import all_forward_configs, describe

_PTXAS_PATTERNS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_report(ptx: Path, arch: str) -> str:
    result = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                            capture_output=True, text=True, check=False)
    text = result.stdout + result.stderr
    if result.returncode != 0:
        return f"ptxas failed: {text.strip().splitlines()[-1] if text.strip() else result.returncode}"
    found = {name: pattern.search(text) for name, pattern in _PTXAS_PATTERNS.items()}
    values = {name: (match.group(1) if match else "?") for name, match in found.items()}
    return (f"{values['registers']} registers, stack {values['stack']} B, "
            f"spills {values['spill_stores']}/{values['spill_loads']} B (store/load)")


def _compile_one(index: int, dump_dir: str | None, arch: str) -> tuple[int, float, str | None, list[str]]:
    """Compile config ``index`` in this process -> (index, seconds, error or None, new PTX files)."""
    from cp_linear.kernels.cache import compile_kernel

    config = all_forward_configs()[index]
    def ptx_times() -> dict[str, int]:
        if not dump_dir:
            return {}
        return {name: os.stat(Path(dump_dir) / name).st_mtime_ns for name in os.listdir(dump_dir)
                if name.endswith(".ptx")}

    before = ptx_times()  # PTX names can repeat across configs: look for new *or rewritten* files
    started = time.perf_counter()
    try:
        compile_kernel(config)
        error = None
    except Exception as err:  # report and keep compiling the others
        error = f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - started
    changed = sorted(name for name, stamp in ptx_times().items() if before.get(name) != stamp)
    return index, seconds, error, [str(Path(dump_dir) / name) for name in changed]


def _set_environment(arch: str, dump_dir: str | None) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch
    if dump_dir:
        os.environ["CUTE_DSL_KEEP"] = "ptx"
        os.environ["CUTE_DSL_DUMP_DIR"] = dump_dir


def _worker_init(arch: str, dump_dir: str | None) -> None:
    _set_environment(arch, dump_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_linear.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile every kernel config")
    parser.add_argument("--arch", default="sm_90a", help="target architecture (default sm_90a)")
    parser.add_argument("--ptxas", action="store_true", help="report registers and spills from ptxas -v")
    parser.add_argument("--only", default=None, help="compile only configs whose description contains TEXT")
    parser.add_argument("--jobs", type=int, default=1, help="compile in N processes (default 1)")
    args = parser.parse_args(argv)
    if not args.compile:
        parser.print_help()
        return 0
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; received {args.jobs}")
    ptxas = args.ptxas and shutil.which("ptxas") is not None
    if args.ptxas and not ptxas:
        print("ptxas is not on PATH: no register report", file=sys.stderr)
    dump_dir = tempfile.mkdtemp(prefix="cp_linear_ptx_") if ptxas else None
    _set_environment(args.arch, dump_dir)

    configs = all_forward_configs()
    chosen = [i for i, config in enumerate(configs) if args.only is None or args.only in describe(config)]
    print(f"compiling {len(chosen)} GDP kernel configs for {args.arch}", flush=True)
    started = time.perf_counter()
    failures = 0

    def report(index: int, seconds: float, error: str | None, ptx_files: list[str]) -> None:
        nonlocal failures
        name = describe(configs[index])
        if error:
            failures += 1
            print(f"FAILED  {name}: {error}", flush=True)
            return
        line = f"ok      {name}  {seconds:5.1f} s"
        if ptxas and ptx_files:
            line += "  |  " + "; ".join(_ptxas_report(Path(f), args.arch) for f in ptx_files)
        print(line, flush=True)

    if args.jobs == 1 or ptxas:  # PTX files are attributed by directory listing: one process at a time
        for index in chosen:
            report(*_compile_one(index, dump_dir, args.arch))
    else:
        with ProcessPoolExecutor(args.jobs, initializer=_worker_init, initargs=(args.arch, None)) as pool:
            for result in pool.map(_compile_one, chosen, [None] * len(chosen), [args.arch] * len(chosen)):
                report(*result)
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
    total = time.perf_counter() - started
    print(f"{len(chosen) - failures} of {len(chosen)} compiled in {total:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
