"""benchmarks/bench_jax_kernels.py's ``interleaved_wall_ms``: variants take turns, so a drift during the run (here
a sleep that grows with every call) costs each variant alike, where timing them one after another would charge
it to the last; and each variant's median comes from its own calls."""

import importlib.util
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports _bench_common beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_jax_kernels_under_test",
                                                      BENCHMARKS / "bench_jax_kernels.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _drifting_calls():
    """Two identical variants whose every call sleeps 0.2 ms longer than the call before (any variant's)."""
    calls = []

    def call(name):
        calls.append(name)
        time.sleep(0.0002 * len(calls))
        return name

    return calls, {"first": (lambda: call("first"), lambda _: None), "second": (lambda: call("second"), lambda _: None)}


def test_interleaved_variants_share_a_drift():
    bench = _bench()
    calls, variants = _drifting_calls()
    medians = bench.interleaved_wall_ms(variants, repeat=20, rounds=4, warmup=1)
    assert calls.count("first") == calls.count("second") == 1 + 20  # warm-up, then 4 rounds of 5
    assert abs(medians["first"] - medians["second"]) < 0.25 * medians["first"]
    calls, variants = _drifting_calls()
    one_after_another = bench.interleaved_wall_ms(variants, repeat=20, rounds=1, warmup=1)
    assert one_after_another["second"] > 1.5 * one_after_another["first"]  # the drift the rounds spread out


def test_wall_ms_is_the_median_of_its_own_calls():
    bench = _bench()
    durations = iter([0.001, 0.009, 0.001, 0.002, 0.003])  # one warm-up, then four timed calls
    assert 1.5 < bench.wall_ms(lambda: time.sleep(next(durations)), lambda _: None, repeat=4, warmup=1) < 4.5
