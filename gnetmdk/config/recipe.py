"""The quantized stages' training schedule that every example config shares (docs/results.md).

A config writes ``per_step = {1: dict(...), **quantized_stages()}``: its own float training (step 1,
whose length depends on the dataset), and for steps 2 to 4 the one schedule measured on cards,
raccoon and the shapes demo over three seeds each. Any value can still be set per stage on top
(``per_step[3]["num_epochs"] = 20``) or on the command line.
"""
from __future__ import annotations

import math
from typing import Dict, Union


def quantized_stages(epoch_factor: float = 1.0) -> Dict[Union[int, str], dict]:
    """The per_step entries of steps 2, cal, 3 and 4, as fresh dicts.

    Fine-tuning at 1e-4 (2e-5 in step 4) with AdamW, cosine after a half-epoch warm-up, 10 + 10 + 6
    epochs, an EMA of the weights (decay 0.99; in steps 3 and 4 ramped over the first 20 optimizer
    steps) that is evaluated every 2 epochs and kept as best.pth. Step 4 starts from exactly step 3's
    best model; without an EMA its training lowered val mAP on cards in every run. Against 3 + 3 + 2
    epochs without an EMA, over seeds 0-2 step 4 - step 1 went from -1.2 (worst -2.0) to -0.8 (worst
    -1.7) points on the shapes demo and from -3.1 (worst -9.6) to -1.6 (worst -3.7) on raccoon
    (docs/results/accuracy-matrix.md).

    Args:
        epoch_factor: the same schedule in optimizer steps for a dataset whose epochs have 1 / factor
            times the steps of the one a config derives from (examples/facemask_tiles.py: its tiles
            give 115 steps an epoch where the photos give 42, factor 42 / 115). Epoch counts and the
            evaluation interval are scaled and rounded half up, at least 1; the warm-up (a fraction of
            an epoch) is scaled exactly. 1.0 is the schedule as measured.

    Returns:
        {2: {...}, "cal": {}, 3: {...}, 4: {...}}: config field -> value per stage.

    Raises:
        ValueError: ``epoch_factor`` not a finite number above 0 (a bool is no number here).
    """
    if not (isinstance(epoch_factor, (int, float)) and not isinstance(epoch_factor, bool)
            and math.isfinite(epoch_factor) and epoch_factor > 0):
        raise ValueError(f"quantized_stages: epoch_factor must be a number above 0, got {epoch_factor!r}")

    def epochs(n: int) -> int:
        return n if epoch_factor == 1.0 else max(1, int(math.floor(n * epoch_factor + 0.5)))

    ema = dict(warmup_epochs=0.5 * epoch_factor, eval_interval=epochs(2), ema=True, ema_decay=0.99)
    return {
        2: dict(learning_rate=1e-4, num_epochs=epochs(10), **ema),
        "cal": dict(),
        3: dict(learning_rate=1e-4, num_epochs=epochs(10), ema_ramp=20, **ema),
        4: dict(learning_rate=2e-5, num_epochs=epochs(6), ema_ramp=20, **ema),
    }
