"""The run, above the recipes: what uses an objective (pipeline/objectives/) and the machinery under it
(pipeline/train/).

    resume.py    start or resume: the process group, the run directory's lock, the plan (which checkpoint,
                 how it loads), what a resume restores, in order
    finetune.py  a fine-tune's preparation: its source, the source's architecture, the weights loaded
    trainer.py   the Trainer: config, run directory, engine and the parts it checkpoints; the step loop

`pipeline.commands` turns a command line into a run config and hands it here.
"""
