"""Every benchmark of the project, outside the installed package; `launch/bench.py` is the entry point
and `make bench` runs them all. Each appends a row to results/benchmarks.csv (`benchmarks.results`);
`benchmarks.render` makes docs/benchmarks.md from it.

    model       ours vs timm's VisionTransformer: training-step images/s, MFU, the ratio    (benchmarks.model)
    engine      DeepSpeed ZeRO 0-3 vs a plain PyTorch loop, and train.check_finite's cost  (benchmarks.engine)
    e2e         shards -> train loader -> DeepSpeed step vs synthetic tensors on the device (benchmarks.e2e)
    gpu         B/16 and L/16 MFU, end to end, bf16/nvjpeg checks on one GPU               (benchmarks.gpu)
    loader      train stream vs ImageFolder vs the decode+transform ceiling                (benchmarks.loader)
    preemption  the per-step preemption agreement over the ranks                           (benchmarks.preemption)

model/engine/e2e/gpu: each `run(spec, ...)` returns a dict of figures; benchmarks.cli adds flags,
presets and tables.
"""
