"""Run a launch/ script with a fault injected on one rank, in the rank's own process (no test hooks in
the package). Used by test_hangs.py as the script the DeepSpeed launcher starts:

    deepspeed --num_gpus 2 tests/integration/inject.py launch/pretrain.py --config ... [overrides]

FAULT (environment) says what happens on rank FAULT_RANK (default 1), at its first evaluation:
  signal-in-eval     SIGUSR1 to itself as the pass starts (a preemption arriving during evaluation)
  kill-eval-worker   SIGKILL to its eval DataLoader worker after the pass's first batch
  kill-eval-workers  SIGKILL to its eval worker at every batch, the restarted ones too (more deaths than
                     the pass's restart budget, pipeline.data.eval.WORKER_RESTARTS)
  fail-final-eval    a TypeError from its final evaluation (at train.steps), as a model that a set cannot
                     judge raised one (run with FAULT_RANK=0 for a single process)
With EXIT_CODES=FOLDER, each rank writes its exit code to FOLDER/rank<RANK> as it leaves.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Under the guard: a DataLoader worker may run this file again as __mp_main__ (see launch/pretrain.py).
if __name__ == "__main__":
    from pipeline.signals import install_signal_handlers

    install_signal_handlers()  # as the launch scripts do, first

    import psutil

    import pipeline.run.trainer as trainer

    args = sys.argv[1:]
    script = next(a for a in args if a.endswith(".py"))
    args.remove(script)
    sys.argv = [script, *args]
    FAULT, FAULT_RANK = os.environ["FAULT"], int(os.environ.get("FAULT_RANK", "1"))
    real_evaluate, done = trainer.Trainer.evaluate, []


    def kill_eval_worker() -> None:
        workers = [p for p in psutil.Process().children(recursive=True) if p.name() == "eval-worker"]
        assert workers, "no eval worker to kill"
        workers[0].kill()
        print(f"inject: rank {FAULT_RANK} killed its eval worker {workers[0].pid}", file=sys.stderr, flush=True)


    def evaluate(s, step):
        if s.env.rank != FAULT_RANK or done or (FAULT == "fail-final-eval" and step < s.cfg.train.steps):
            return real_evaluate(s, step)
        done.append(True)
        if FAULT == "fail-final-eval":
            raise TypeError(f"inject: rank {FAULT_RANK}'s final evaluation (step {step}) failed")
        if FAULT == "signal-in-eval":
            os.kill(os.getpid(), signal.SIGUSR1)
            print(f"inject: rank {FAULT_RANK} got SIGUSR1 as its evaluation started", file=sys.stderr, flush=True)
        elif FAULT == "kill-eval-workers":
            progress = s.eval_loaders[0].progress  # the validation pass

            def kill_every_worker() -> None:
                progress()
                if any(p.name() == "eval-worker" for p in psutil.Process().children(recursive=True)):
                    kill_eval_worker()

            s.eval_loaders[0].progress = kill_every_worker
        elif FAULT == "kill-eval-worker":
            progress, batches = s.eval_loaders[0].progress, []  # the validation pass

            def after_first_batch() -> None:
                progress()
                batches.append(1)
                if len(batches) == 2:  # the first batch is in hand, the worker is preparing the next ones
                    kill_eval_worker()

            s.eval_loaders[0].progress = after_first_batch
        else:
            raise SystemExit(f"inject: unknown FAULT={FAULT!r}")
        return real_evaluate(s, step)


    trainer.Trainer.evaluate = evaluate
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if os.environ.get("EXIT_CODES"):
            Path(os.environ["EXIT_CODES"], f"rank{os.environ.get('RANK', '0')}").write_text(str(e.code))
        raise
