"""BaseConfig: every setting of a gnetmdk run, typed, with derived paths.

A user's ``configs.py`` holds ``class Config(BaseConfig)`` and assigns only what differs for their
dataset (DS_NAME, VOC_CLASSES, batch_size, ...). The value a run uses is resolved as

    command line  >  Config.per_step[step]  >  Config (class attributes)  >  BaseConfig

Every field is declared here with a type annotation; the annotation is what command-line values
are converted to (see :mod:`gnetmdk.config.overrides`).
"""
from __future__ import annotations

import os
import typing
from typing import Any, Dict, List

# the sections' registry is gnetmdk.config.registry's; SECTIONS and register_section are re-exported here
from .registry import SECTIONS, get_family, register_section, sections  # noqa: F401


class ConfigError(ValueError):
    """A configuration value or override that cannot be used; the message names the field and the fix."""


#: environment variable: "refuse" makes a config left at ``device auto`` an error (the test suite sets
#: it, so that every test pins the device it tests and a GPU machine runs the CPU tests on the CPU)
AUTO_DEVICE_ENV = "GNETMDK_AUTO_DEVICE"


def cuda_wanted(device: str) -> bool:
    """Whether a config's ``device`` ("auto" | "cpu" | "cuda") means CUDA here: "cuda", or "auto" where
    torch sees a GPU. The one place "auto" is resolved (the trainer, the launcher, the chip tools).

    Raises:
        ConfigError: ``device auto`` while the environment variable GNETMDK_AUTO_DEVICE is "refuse".
    """
    if device == "auto":
        if os.environ.get(AUTO_DEVICE_ENV, "") == "refuse":
            raise ConfigError(f"device auto refused ({AUTO_DEVICE_ENV}=refuse, as the test suite sets it): "
                              "pin device cpu or device cuda")
        import torch
        return torch.cuda.is_available()
    return device == "cuda"


#: ``tf32`` values: "auto" (the default) = TF32 in the float stages (step 1 and the float control), IEEE
#: float32 in steps 2-4 and calibration; "on" / "off" (or true / false) everywhere. Measured on an H100
#: (docs/training.md, "Fast defaults on a GPU"): step 1 at 448 px 2.1x faster, step-1 mAP on cards
#: within seed noise; the quantized stages keep IEEE float32 so that they compute what a CPU computes.
TF32_MODES = ("auto", "on", "off")
_ON = {"on", "true", "yes", "y", "1"}
_OFF = {"off", "false", "no", "n", "0"}


def tf32_mode(value) -> str:
    """A ``tf32`` config value (a string, or a bool from an older config or checkpoint) -> one of
    :data:`TF32_MODES`.

    Raises:
        ValueError: any other value (validate_config turns it into a one-line config error).
    """
    if isinstance(value, bool):
        return "on" if value else "off"
    low = str(value).strip().lower()
    if low in _ON:
        return "on"
    if low in _OFF:
        return "off"
    if low == "auto":
        return "auto"
    raise ValueError(f"tf32 must be auto, on or off, got {value!r}")


def _annotated_fields(klass) -> Dict[str, Any]:
    """Every annotated field name of ``klass`` and its bases, mapped to its declared type."""
    types: Dict[str, Any] = {}
    for k in reversed(klass.__mro__):
        if k is object:
            continue
        try:
            hints = typing.get_type_hints(k)
        except Exception:  # pragma: no cover - annotations that cannot be evaluated
            hints = getattr(k, "__annotations__", {})
        types.update({n: t for n, t in hints.items() if not n.startswith("_")})
    return types


class ConfigSection:
    """The fields of one model family, resolved as ``cfg.<family>`` (e.g. ``cfg.gnetdet.l_coord``).

    A family declares its section as a subclass with typed class attributes (the defaults) and
    registers it with :func:`register_section`; gnetmdk.config.overrides resolves it like the
    top-level fields (configs.py dict < per_step < command line). Instances hold the resolved values.
    """

    @classmethod
    def field_types(cls) -> Dict[str, Any]:
        """Every field name mapped to its declared type."""
        return _annotated_fields(cls)

    def to_dict(self) -> Dict[str, Any]:
        """The resolved values as plain Python types."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in
                ((k, getattr(self, k)) for k in self.field_types())}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


def ensure_sections() -> Dict[str, type]:
    """The registered sections ({name: ConfigSection subclass}), after loading the model families that
    register them (gnetmdk.config.registry.sections)."""
    return sections()


class BaseConfig:
    """Defaults of every field. Subclass it in configs.py; never edit it for one dataset.

    Paths are relative to the current working directory unless absolute.
    """

    # ---------------------------------------------------------------- dataset
    DS_NAME: str = "shapes"                 # dataset folder name under data_root, and meta file prefix
    VOC_CLASSES: List[str] = ["circle", "square", "triangle"]
    data_root: str = "data"                 # datasets live in <data_root>/<DS_NAME> ...
    dataset_path: str = ""                  # ... unless this names the VOC folder directly
    meta_root: str = "data/meta"            # <meta_root>/<DS_NAME>_train.txt and _valid.txt
    train_json: str = ""                    # a COCO-json training split instead of the meta file (tools/xml_2_json.py)
    val_json: str = ""                      # ... and its validation split
    image_dir: str = "JPEGImages"
    max_train_images: int = 0               # 0 = all; >0 keeps the first N (tests, smoke runs)
    shapes_objects: List[int] = [1, 3]      # run_pipeline --make-shapes: shapes per image, lo and hi
    shapes_images: List[int] = [240, 60]    # ... and the train and val images it makes
    shapes_upright: bool = False            # ... with every triangle's apex above its base (else either way up)
    max_val_images: int = 0
    cache_images: bool = True               # decode every image once (downscaled) and keep it in memory
    #                                         (a split without augmentation keeps its finished samples too)
    augment: bool = True                    # training augmentation (the family's own: cfg.<family> section)

    # ---------------------------------------------------------------- model
    model_name: str = "gnetdet"             # the model family (gnetmdk.models): gnetdet | ppyolo
    image_size: int = 448                   # input side in pixels (GNetDet: 224 or 448; 5801 also 320, 640)
    channels_last: bool = True              # NHWC memory format (faster convolutions on CPU)
    inplace_abn: bool = False               # BatchNorm + ReLU/leaky as one layer that keeps less for backward
    recompute_stem: bool = False            # the first conv-BN-act(-pool) keeps only the image; recomputed in backward
    # each family's own fields are a section of the config: cfg.gnetdet (gnetmdk/models/gnetdet/config.py),
    # cfg.ppyolo (gnetmdk/models/ppyolo/config.py); set them in configs.py as a dict (gnetdet = dict(...))
    # or by their own names, and on the command line as gnetdet.l_coord 3 or l_coord 3

    # ---------------------------------------------------------------- optimisation
    batch_size: int = 16                    # global batch: split over world_size x gpus processes
    learning_rate: float = 1e-4
    optimizer: str = "adamw"                # adamw | adam | sgd
    momentum: float = 0.9
    nesterov: bool = True                   # sgd: Nesterov momentum; false = plain momentum (PaddleDetection's
                                            # Momentum optimizer, which the PP-YOLO recipes use)
    weight_decay: float = 5e-4
    grad_clip: float = 10.0                 # max gradient norm, 0 = off
    num_epochs: int = 30
    # train at least this many optimizer steps: the stage's epochs become max(num_epochs,
    # ceil(min_steps / steps per epoch)), so a small dataset is not left with a few dozen steps (0 = off)
    min_steps: int = 0
    lr_scheduler: str = "cosine"            # cosine | cosine_restarts | step | multistep | constant
    warmup_epochs: float = 1.0              # linear warm-up length in epochs (stepped per iteration)
    warmup_factor: float = 0.1              # lr multiplier at the first iteration of the warm-up
    min_lr_ratio: float = 0.01              # cosine floor, as a fraction of learning_rate
    lr_step_size: int = 10                  # StepLR period (epochs)
    lr_milestones: List[int] = [20, 25]     # MultiStepLR milestones (epochs)
    lr_gamma: float = 0.1
    lr_restart_epochs: float = 10.0         # CosineAnnealingWarmRestarts: first period (epochs)
    lr_restart_mult: int = 1                # ... and its growth factor
    num_workers: int = 2
    seed: int = 0
    threads: int = 0                        # intra-op threads per rank (torch.set_num_threads); 0 = torch's
                                            # default in one process, cores / processes with several
    # training recipe (docs/training.md)
    amp: bool = False                       # mixed precision: autocast (+ GradScaler for fp16 on CUDA)
    amp_dtype: str = "bf16"                 # bf16 | fp16 (fp16 on CUDA only; CPU autocast is always bf16)
    accumulate: int = 1                     # micro-batches per optimizer step (batch_size is per step)
    ema: bool = False                       # keep an EMA of the weights; evaluated and used for best.pth
    ema_decay: float = 0.999
    ema_ramp: float = 200.0                 # optimizer steps over which the EMA decay ramps up
    distill: float = 0.0                    # steps 2-4: weight of the distillation term from the float model (0 = off)
    distill_from: str = ""                  # the teacher checkpoint (default <checkpoint_root>/step1/best.pth)
    checkpoint_interval: int = 0            # also save last.pth every N optimizer steps (0 = epoch ends only)
    disk_reserve_mb: float = 0.0            # free disk required beyond the estimated checkpoint size
    device: str = "auto"                    # auto | cpu | cuda
    tf32: str = "auto"                      # CUDA: float32 convs / matmuls in TF32 (10-bit mantissa): auto = step 1
                                            # only, on / off = steps 1-3 / never; never exact paths (docs/training.md)
    cpu_keep_memory: bool = True            # CPU: malloc keeps freed memory (no page faults per step; docs/training.md)

    # ---------------------------------------------------------------- stages
    step: int = 1                           # 1..4 (configs.py sets it through DEFAULT_STEP)
    cal: bool = False                       # calibration pass (runs on the step-2 model)
    load: str = ""                          # checkpoint to start from; "" = previous step's best
    resume: bool = False                    # continue from this step's last.pth
    resume_changes: List[str] = []          # settings a resume may change (schedule, world_size; docs/training.md)
    eval_before: bool = True                # evaluate the loaded model before training
    eval_interval: int = 1                  # evaluate every N epochs (and always after the last)
    eval_from: int = 0                      # no evaluation after epochs before this one (counted from 1) but the
                                            # last: 0 = from the first; a plateau check needs only the last quarter
    eval_batch_size: int = 0                # images per evaluation forward on every rank (0 = batch_size); the
                                            # last batch is padded: outputs independent of the process count
    patience: int = 0                       # early stopping: end the stage when val mAP has not improved for N epochs (0 = off)
    per_step: Dict[int, dict] = {}          # {step: {field: value}} applied before command-line overrides

    # ---------------------------------------------------------------- distributed and alignment
    dist_timeout: float = 300.0             # seconds to wait for peers to join, and for each collective
    bn_running_var: str = "unbiased"        # BatchNorm running variance from the unbiased batch variance
                                            # (torch) or the biased one ("biased": PaddlePaddle, for the
                                            # alignment with PaddleDetection; docs/alignment.md)
    sync_bn: bool = True                    # world size > 1: BatchNorm statistics of the global batch
    save_npz: str = ""                      # alignment: record batches, losses, starting weights here
    replay_npz: str = ""                    # alignment: train on the batches recorded here, compare losses
    max_iters: int = 0                      # stop after this many iterations and save last.pth (0 = off)
    deterministic: bool = False             # alignment runs: augmentation off, deterministic torch kernels,
                                            # every reduction over ranks in rank order (DDP's too)
    virtual_ranks: int = 1                  # ranks per process, run in turns by threads: V virtual ranks of P
                                            # processes compute what V x P processes compute, bit for bit
                                            # (a replay sets it from its recording; docs/alignment.md)
    replay_merged: bool = False             # replay: feed each iteration's recorded ranks as one merged batch per
                                            # process (the notes' plain comparison: round-off expected)

    # ---------------------------------------------------------------- decoding and evaluation
    # keep boxes with conf * class score above this for mAP: AP integrates precision over all recall, so
    # a high threshold cuts the tail of the precision-recall curve (0.05 cost 0.2-1.1 points on cards)
    conf_thresh: float = 0.01
    nms_thresh: float = 0.5
    max_detections: int = 100
    predict_thresh: float = 0.3             # drawing threshold of tools/predict.py
    eval_coco: bool = False                 # also COCO mAP@[.5:.95] (pycocotools) at every evaluation
    eval_stitch: bool = False               # a tiled dataset (tools/tile_voc.py): every evaluation's mAP, and the
                                            # best.pth it picks, on the whole val images (the tiles' mAP beside
                                            # it; gnetmdk.evaluation.stitch, docs/training.md)
    tb_images: int = 4                      # val images drawn with their predictions into tensorboard at each evaluation

    # ---------------------------------------------------------------- outputs
    checkpoint_root: str = "checkpoint"
    log_root: str = "log"
    model_root: str = "model"
    progress: bool = True                   # tqdm bar per epoch (on a terminal only)

    # ================================================================= derived values
    @property
    def dataset_dir(self) -> str:
        """The VOC folder: ``dataset_path`` if set, else ``<data_root>/<DS_NAME>``."""
        return self.dataset_path or os.path.join(self.data_root, self.DS_NAME)

    @property
    def meta_dir(self) -> str:
        """The folder of the meta files (``meta_root``)."""
        return self.meta_root

    @property
    def train_meta(self) -> str:
        """The training list: ``<meta_root>/<DS_NAME>_train.txt``."""
        return os.path.join(self.meta_root, f"{self.DS_NAME}_train.txt")

    @property
    def valid_meta(self) -> str:
        """The validation list: ``<meta_root>/<DS_NAME>_valid.txt``."""
        return os.path.join(self.meta_root, f"{self.DS_NAME}_valid.txt")

    @property
    def num_classes(self) -> int:
        """C, the number of object classes (``len(VOC_CLASSES)``)."""
        return len(self.VOC_CLASSES)

    @property
    def grid_size(self) -> int:
        """Output grid side: image_size / 32 (14 at 448 and at 224, whose first pool is dropped)."""
        return 14 if self.image_size in (224, 448) else self.image_size // 32

    @property
    def stage_name(self) -> str:
        """``"cal"`` for the calibration pass, else ``"step<N>"``."""
        return "cal" if self.cal else f"step{self.step}"

    def checkpoint_dir(self, step: int | None = None) -> str:
        """``<checkpoint_root>/step<N>`` (N defaults to this run's step; cal writes into step2)."""
        return os.path.join(self.checkpoint_root, f"step{self.step if step is None else step}")

    @property
    def log_dir(self) -> str:
        """This stage's log folder: ``<log_root>/<stage_name>`` (``cal`` or ``step<N>``)."""
        return os.path.join(self.log_root, self.stage_name)

    # ================================================================= field access
    @classmethod
    def field_types(cls) -> Dict[str, Any]:
        """Every top-level field name mapped to its declared type, collected over the class hierarchy
        (the families' sections: :meth:`section_types`)."""
        return _annotated_fields(cls)

    @classmethod
    def section_types(cls) -> Dict[str, Dict[str, Any]]:
        """{section name: {field: type}} of every registered family section."""
        return {name: klass.field_types() for name, klass in ensure_sections().items()}

    def section(self, name: str | None = None) -> "ConfigSection":
        """The section of family ``name`` (default: the run's model family, ``model_name``)."""
        if name is None:
            name = get_family(self.model_name).name
        return getattr(self, name)

    def to_dict(self) -> Dict[str, Any]:
        """Resolved values of every field (plain Python types: safe to store in a checkpoint); each
        family section as a nested dict under its name."""
        out = {}
        for name in self.field_types():
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            if isinstance(value, dict):   # per_step: keys 1..4 and "cal" -> strings (JSON, sorting)
                value = {str(k): dict(v) if isinstance(v, dict) else v for k, v in value.items()}
            out[name] = value
        for name in ensure_sections():
            sec = getattr(self, name, None)
            if isinstance(sec, ConfigSection):
                out[name] = sec.to_dict()
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"{type(self).__name__}({body})"
