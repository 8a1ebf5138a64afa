"""DINOv2's losses, one file each as Meta's `dinov2/loss/`: `DINOLoss` (dino_clstoken_loss.py),
`iBOTPatchLoss` (ibot_patch_loss.py), `KoLeoLoss` (koleo_loss.py), with the official classes' names,
constructor arguments, buffers (`center`) and methods, so code and checkpoints written against Meta's move
across unchanged (checked against the official code in tests/unit/test_dino_official.py, skipped without
DINOV2_OFFICIAL_REPO).

Where we differ from Meta's code, on purpose:

- Distributed: where the official code all-reduces (the centre update, the Sinkhorn-Knopp sums and, for
  iBOT, the number of masked patches) ours all-reduces too, synchronously, whenever a default process
  group is initialised (sinkhorn_knopp.py); so 2 ranks with half the batch each give the centre and teacher
  assignments of 1 rank with all of it (tests/unit/test_dino_pieces.py). Meta's centre update is
  asynchronous: the all-reduce is started in `update_center` and the new centre is applied lazily at the
  next `softmax_center_teacher`. Ours applies it in `update_center`. In Meta's loop (softmax of this step's
  teacher output, then `update_center` with it) the centre each softmax sees is the same; the difference
  is that our `center` buffer is up to date the moment a step ends, so a checkpoint taken then holds the
  update (Meta's would lose a pending one). `apply_center_update` is kept for code that calls it and does
  nothing, since no update is ever pending.
- KoLeo turns autocast off with `torch.autocast(device_type=..., enabled=False)` for the input's device
  (Meta's uses the CUDA-only, deprecated `torch.cuda.amp.autocast`). As in Meta's code it is computed
  per rank: nearest neighbours among the rank's own class tokens, no all-reduce.
"""

from pipeline.objectives.dino.loss.dino_clstoken_loss import DINOLoss
from pipeline.objectives.dino.loss.ibot_patch_loss import iBOTPatchLoss
from pipeline.objectives.dino.loss.koleo_loss import KoLeoLoss

__all__ = ["DINOLoss", "KoLeoLoss", "iBOTPatchLoss"]
