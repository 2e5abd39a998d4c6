"""Helpers the GDP benchmark scripts share (imported as a sibling: ``python benchmarks/<script>.py`` puts
``benchmarks/`` first on ``sys.path``): CUDA-event timing, torch.profiler kernel times, the
``DOCSxDOC_TOKENS:NH`` case strings and the packed bf16 inputs of those cases."""

from __future__ import annotations

import statistics

import torch


def time_ms(fn, repeat: int, warmup: int = 3) -> float:
    """Median ms of ``repeat`` calls of ``fn`` after ``warmup`` calls, each call between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def back_to_back_ms(fn, steps: int = 10) -> float:
    """ms per step over ``steps`` steps queued back to back (one sync at the end), as a training loop
    runs them: a host sync inside a step drains the queue here, unlike in ``time_ms``."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / steps


def kernel_times(fn, repeat: int) -> dict[str, float]:
    """GPU time per call (ms, from torch.profiler) of every kernel ``fn`` launches, by the kernel's full name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            out[event.key] = device_us / repeat / 1e3
    return out


def parse_case(case: str) -> tuple[int, int, int]:
    """``"DOCSxDOC_TOKENS:NH"`` -> (docs, doc_tokens, nh)."""
    shape, nh = case.split(":")
    docs, doc_tokens = (int(x) for x in shape.split("x"))
    return docs, doc_tokens, int(nh)


def make_inputs(docs: int, doc_tokens: int, heads: int, dim: int, nh: int, seed: int = 0,
                generator: torch.Generator | None = None):
    """q, k, v (bf16), g, beta (float32) and cu_seqlens of ``docs`` packed documents of ``doc_tokens`` tokens
    in one row, n_h = ``nh`` (K = V = ``dim``). Drawn from ``generator`` when given (the caller draws more
    after), else from a fresh CUDA generator seeded with ``seed``."""
    gen = generator if generator is not None else torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    tokens = docs * doc_tokens
    q = rand(1, tokens, heads, dim).bfloat16()
    k = rand(1, tokens * nh, heads, dim).bfloat16()
    v = rand(1, tokens * nh, heads, dim).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0).float()
    beta = torch.sigmoid(rand(1, tokens * nh, heads)).float()
    cu = torch.arange(0, tokens + 1, doc_tokens, dtype=torch.int32, device="cuda")
    return q, k, v, g, beta, cu
