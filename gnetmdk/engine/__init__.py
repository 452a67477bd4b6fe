"""Trainer, its hooks, the stage table, schedules, calibration (import the submodules you need:
gnetmdk.engine.trainer.Trainer, gnetmdk.engine.stages.STAGES, ...; nothing is imported here, so that
the hooks can be imported by modules the trainer itself imports)."""
