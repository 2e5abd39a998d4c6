"""Multi-process JAX: the CP ops under ``jax.distributed`` (2 processes x 2 CPU devices, gloo CPU
collectives) give the results of one process with 4 devices: the path a multi-node user takes.

Two worker processes (tests/jax_api/multiprocess_worker.py) join a coordinator on a free port and
run GDP forward + gradients and block-diagonal attention forward + gradients on a packing that
spans all 4 devices; the test process runs the same function on 4 of its own host devices while
they work. Every wait has a deadline and the workers are killed on the way out, so the test can
fail but never hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from cp_linear import reference as ref  # noqa: E402
from tests.jax_api import multiprocess_worker as worker  # noqa: E402
from tests.tolerance import assert_close, attention_length, gdp_length, tolerance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUM_PROCESSES, LOCAL_DEVICES = 2, 2
DEADLINE_S = 540  # compiling the GDP backward for 4 devices takes about a minute on 2 busy cores


def gloo_cpu_collectives_missing() -> str | None:
    """Why this jaxlib cannot run collectives between CPU processes, or None when it can (gloo:
    JAX's ``jax_cpu_collectives_implementation`` option and jaxlib's TCP gloo collectives)."""
    from jax._src import config

    option = getattr(config, "cpu_collectives_implementation", None)
    if option is None:
        return f"jax {jax.__version__} has no jax_cpu_collectives_implementation option"
    try:
        from jax._src.lib import _jax
    except ImportError:
        return None  # jaxlib moved its internals: run, and let the workers say what fails
    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        return f"jaxlib {jax.__version__} was built without gloo CPU collectives (no make_gloo_tcp_collectives)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(out: Path, logs: Path) -> list[tuple[subprocess.Popen, Path]]:
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # the worker sets its own device count before importing jax (and keeps the session's other XLA flags)
    workers = []
    for process_id in range(NUM_PROCESSES):
        log = logs / f"worker{process_id}.log"
        command = [sys.executable, "-m", "tests.jax_api.multiprocess_worker", "--out", str(out),
                   "--process-id", str(process_id), "--num-processes", str(NUM_PROCESSES),
                   "--coordinator", coordinator, "--local-devices", str(LOCAL_DEVICES)]
        with open(log, "w") as handle:
            workers.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT), log))
    return workers


def wait_for(workers, deadline: float) -> None:
    """Wait until every worker exits (killing all at the deadline); raise with their logs if one failed."""
    try:
        for process, _ in workers:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process, _ in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = [(process.returncode, log) for process, log in workers if process.returncode != 0]
    if failed:
        tails = "\n".join(f"--- {log.name} (exit {code}):\n{log.read_text()[-3000:]}" for code, log in failed)
        raise AssertionError(f"a worker failed or ran past {DEADLINE_S} s:\n{tails}")


@pytest.mark.multirank
@pytest.mark.timeout(DEADLINE_S + 60)
def test_two_processes_of_two_cpu_devices_match_one_process_of_four(tmp_path):
    missing = gloo_cpu_collectives_missing()
    if missing:
        pytest.skip(missing)
    deadline = time.monotonic() + DEADLINE_S
    workers = start_workers(tmp_path / "two_processes", tmp_path)
    try:
        mesh = jax.make_mesh((4,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
        one_process = worker.run_ops(mesh)  # the single-process reference, computed while the workers run
    finally:
        wait_for(workers, deadline)
    out = tmp_path / "two_processes"
    assert (out / "done").read_text().startswith(f"{NUM_PROCESSES} processes, 4 devices")

    from jax_api.attention.blockdiag import plan_blockdiag_exchange

    doc_ids = worker.global_inputs()[-1]
    assert plan_blockdiag_exchange(doc_ids, 4).mode == "a2a", "document 2 should span three ranks"
    tokens = worker.TOKENS
    bounds = {"gdp": tolerance(gdp_length(tokens, worker.NUM_HOUSEHOLDER, worker.KEY_DIM), compared_with="rounded"),
              "attention": tolerance(attention_length(tokens, worker.HEAD_DIM), compared_with="rounded")}
    for name, expected in one_process.items():
        got = np.load(out / f"{name}.npy")
        assert got.shape == expected.shape, name
        assert_close(f"two processes vs one: {name}", expected, got, bounds[name.split("_")[0]])

    # and the single-process outputs are the right ones (float64 references)
    gdp_inputs, _, _, attention_inputs, _, _ = worker.global_inputs()
    cu_seqlens = np.r_[0, np.cumsum(worker.SEQUENCE_LENGTHS)]
    gdp_reference, _ = ref.naive_gated_delta_product(*(x.astype(np.float64) for x in gdp_inputs),
                                                     num_householder=worker.NUM_HOUSEHOLDER, cu_seqlens=cu_seqlens,
                                                     use_qk_l2norm_in_kernel=True)
    assert_close("gdp output vs float64", gdp_reference, one_process["gdp_output"], bounds["gdp"])
    attention_reference = ref.blockdiag_attention(*(x.astype(np.float64) for x in attention_inputs), doc_ids)
    assert_close("attention output vs float64", attention_reference, one_process["attention_output"],
                 bounds["attention"])
