"""The stage table (what makes each stage of the pipeline different): gnetmdk.models.stages, re-exported
here for the trainer, its hooks and the tools. It sits on the models' floor so that the chip model
(gnetmdk.chip) and the families set a model's switches without importing the engine."""
from gnetmdk.models.stages import STAGES, Stage, apply_stage, get_stage, source_path

__all__ = ["STAGES", "Stage", "apply_stage", "get_stage", "source_path"]
