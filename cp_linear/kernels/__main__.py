"""Compile every GDP kernel ahead of time, without a GPU.

    python -m cp_linear.kernels --compile --arch sm_90a [--ptxas] [--check-tensor-cores]
                                [--only TEXT] [--dtype NAME] [--jobs N] [--library DIR]

Lists each kernel config with its compile time and the tensor-core instructions its PTX holds
(``mma.sync`` / ``wgmma``); ``--check-tensor-cores`` fails unless every tensor-core kernel has
them; ``--ptxas`` also reports registers, stack frame and spills from ``ptxas -arch=<arch> -v``
(when ptxas is on PATH). ``--library DIR`` exports every kernel as a loadable shared object (use
it with ``CP_LINEAR_KERNEL_LIBRARY=DIR``; see ``cache``). Each config compiles in a worker
process that inspects its own PTX, so ``--jobs N`` works with every option.
Exits 1 if any kernel fails to compile or a check fails.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cp_linear.kernels.configs import (
    ChunkGammaConfig,
    ChunkPrepBackwardConfig,
    ChunkPrepConfig,
    ChunkReverseConfig,
    ChunkReverseScanConfig,
    ChunkScanConfig,
    all_configs,
    ci_configs,
    describe,
)

# segment_fold is float32 SIMT by design
TENSOR_CORE_CONFIGS = (ChunkPrepConfig, ChunkScanConfig, ChunkGammaConfig, ChunkReverseScanConfig, ChunkReverseConfig,
                       ChunkPrepBackwardConfig)

_PTXAS_PATTERNS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_report(ptx: str, arch: str) -> str:
    with tempfile.TemporaryDirectory() as work:
        source, cubin = Path(work) / "kernel.ptx", Path(work) / "kernel.cubin"
        source.write_text(ptx)
        result = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(source), "-o", str(cubin)],
                                capture_output=True, text=True, check=False)
        code_bytes = _text_bytes(cubin.read_bytes()) if result.returncode == 0 else 0
    text = result.stdout + result.stderr
    if result.returncode != 0:
        return f"ptxas failed: {text.strip().splitlines()[-1] if text.strip() else result.returncode}"
    found = {name: pattern.search(text) for name, pattern in _PTXAS_PATTERNS.items()}
    values = {name: (match.group(1) if match else "?") for name, match in found.items()}
    return (f"{values['registers']} registers, stack {values['stack']} B, "
            f"spills {values['spill_stores']}/{values['spill_loads']} B (store/load), "
            f"code {code_bytes / 1024:.0f} KB")


def _text_bytes(cubin: bytes) -> int:
    """Bytes of machine code (the ``.text.*`` sections) in an ELF64 cubin: straight-line code that runs
    once per CTA is fetched from L2 every time once it outgrows the instruction cache (~128 KB)."""
    import struct

    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]

    def name(header) -> bytes:
        start = names_at + header[0]
        return cubin[start:cubin.index(b"\0", start)]

    return sum(header[5] for header in headers if name(header).startswith(b".text."))


def _tensor_core_ops(ptx: str) -> list[str]:
    return sorted(op for op in ("wgmma", "mma.sync") if op in ptx)


_DUMP_DIR: list[str] = []


def _use_private_dump_dir(arch: str) -> None:
    """Keep PTX (read back through ``__ptx__``) in a directory of this process's own: the DSL names
    dumped files after the kernel and its argument types, so two configs that differ only in the
    kernel's compile-time attributes share a file name, and concurrent workers would read each
    other's PTX."""
    if not _DUMP_DIR:
        _DUMP_DIR.append(tempfile.mkdtemp(prefix="cp_linear_ptx_"))
        atexit.register(shutil.rmtree, _DUMP_DIR[0], True)
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = _DUMP_DIR[0]


def _compile_one(index: int, arch: str, library: str | None, ptxas: bool, keep_ptx: str | None = None
                 ) -> tuple[int, float, str | None, list[str] | None, str | None]:
    """Compile config ``index`` -> (index, seconds, error, tensor-core ops in its PTX, ptxas report);
    with ``keep_ptx`` the PTX is also written to that directory as ``<artifact name>.ptx``."""
    from cp_linear.kernels.cache import artifact_name, compile_kernel, export_kernel

    _use_private_dump_dir(arch)
    config = all_configs()[index]
    started = time.perf_counter()
    try:
        if library and (Path(library) / f"{artifact_name(config)}.so").exists():
            function = None  # up to date in the library already
        elif library:
            function = export_kernel(config, library)[1]
        else:
            function = compile_kernel(config)
    except Exception as err:  # report and keep compiling the others
        return index, time.perf_counter() - started, f"{type(err).__name__}: {err}", None, None
    seconds = time.perf_counter() - started
    ptx = getattr(function, "__ptx__", None) if function is not None else None
    if not ptx:
        return index, seconds, None, None, None
    if keep_ptx:
        (Path(keep_ptx) / f"{artifact_name(config)}.ptx").write_text(ptx)
    return index, seconds, None, _tensor_core_ops(ptx), _ptxas_report(ptx, arch) if ptxas else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_linear.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile every kernel config")
    parser.add_argument("--arch", default="sm_90a", help="target architecture (default sm_90a)")
    parser.add_argument("--ptxas", action="store_true", help="report registers and spills from ptxas -v")
    parser.add_argument("--only", default=None, help="compile only configs whose description contains TEXT")
    parser.add_argument("--dtype", default=None, help="compile only this input dtype (and the dtype-free kernels)")
    parser.add_argument("--ci", action="store_true", help="only the configs CI compiles (configs.ci_configs)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in N processes (default 1)")
    parser.add_argument("--library", default=None, help="export every kernel to DIR as a prebuilt library")
    parser.add_argument("--keep-ptx", default=None, metavar="DIR", help="write each config's PTX to DIR")
    parser.add_argument("--check-tensor-cores", action="store_true",
                        help="fail unless every tensor-core kernel's PTX holds mma/wgmma instructions")
    args = parser.parse_args(argv)
    if not args.compile:
        parser.print_help()
        return 0
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; received {args.jobs}")
    ptxas = args.ptxas and shutil.which("ptxas") is not None
    if args.ptxas and not ptxas:
        print("ptxas is not on PATH: no register report", file=sys.stderr)

    configs = all_configs()
    in_ci = set(ci_configs())
    chosen = [i for i, config in enumerate(configs) if (args.only is None or args.only in describe(config))
              and (args.dtype is None or getattr(config, "dtype", args.dtype) == args.dtype)
              and (not args.ci or config in in_ci)]
    print(f"compiling {len(chosen)} GDP kernel configs for {args.arch}", flush=True)
    started = time.perf_counter()
    failures = 0

    def report(index: int, seconds: float, error: str | None, ops: list[str] | None, registers: str | None):
        nonlocal failures
        name = describe(configs[index])
        if error:
            failures += 1
            print(f"FAILED  {name}: {error}", flush=True)
            return
        line = f"ok      {name}  {seconds:5.1f} s"
        if ops is not None:
            line += "  |  " + (", ".join(ops) if ops else "no tensor cores")
            if args.check_tensor_cores and type(configs[index]) in TENSOR_CORE_CONFIGS and not ops:
                failures += 1
                line = "FAILED  " + line[8:] + " (expected tensor-core instructions)"
        if registers:
            line += "  |  " + registers
        print(line, flush=True)

    if args.keep_ptx:
        Path(args.keep_ptx).mkdir(parents=True, exist_ok=True)
    work = [(index, args.arch, args.library, ptxas, args.keep_ptx) for index in chosen]
    if args.jobs == 1:
        for item in work:
            report(*_compile_one(*item))
    else:
        with ProcessPoolExecutor(args.jobs, initializer=_use_private_dump_dir, initargs=(args.arch,)) as pool:
            for result in pool.map(_compile_one, *zip(*work)):
                report(*result)
    total = time.perf_counter() - started
    print(f"{len(chosen) - failures} of {len(chosen)} compiled in {total:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
