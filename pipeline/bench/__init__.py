"""Benchmarks of the model, the DeepSpeed engine and the whole input-to-step path (`launch/bench.py`).

    model   ours vs timm's VisionTransformer: training-step images/s, MFU, the ratio    (pipeline.bench.model)
    engine  DeepSpeed ZeRO 0-3 vs a plain PyTorch loop, and train.check_finite's cost  (pipeline.bench.engine)
    e2e     shards -> train loader -> DeepSpeed step vs synthetic tensors on the device (pipeline.bench.e2e)

Each `run(spec, ...)` returns a dict of figures; pipeline.bench.cli adds flags, presets and tables.
"""
