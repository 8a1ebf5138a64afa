"""Run launch/pretrain.py with each rank writing the sample ids of every micro batch it trains on (no test hooks
in the package: the loader is wrapped in the rank's own process, as inject.py does):

    RECORD_IDS=FOLDER python tests/integration/record_ids.py --config ... [overrides]

FOLDER/rank<R>.jsonl gets one line per micro batch: {"positions": [first, end], "ids": [...]}. A micro batch
taken again (a resume, one skipped for a non-finite loss) is written again; the last line of a position wins.
"""

import json
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Under the guard: a DataLoader worker may run this file again as __mp_main__ (see launch/pretrain.py).
if __name__ == "__main__":
    from pipeline.signals import install_signal_handlers

    install_signal_handlers()  # as the launch scripts do, first

    import pipeline.data.train_loader as train_loader

    real_next = train_loader.TrainLoader.__next__

    def recording_next(self):
        out = real_next(self)
        line = {"positions": [self.last_positions.start, self.last_positions.stop], "ids": self.last_ids.tolist()}
        with open(Path(os.environ["RECORD_IDS"], f"rank{self.stream.rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        return out

    train_loader.TrainLoader.__next__ = recording_next
    script = str(ROOT / "launch/pretrain.py")
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
