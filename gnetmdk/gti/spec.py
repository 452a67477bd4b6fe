"""Per-chip limits and weight formats ("mask bits") of the Lightspeeur chips (docs/quantization.md,
"Chip limits" and "Weight formats (mask bits)"; the memory limits: docs/chip.md, "Memory limits",
checked by gnetmdk.gti.memory)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from gnetmdk.config.base import ConfigError


class ChipSpecError(ConfigError):
    """An unknown chip, a weight format the chip does not have, or a network over the chip's memory."""


@dataclass(frozen=True)
class ChipSpec:
    """Limits of one chip.

    Attributes:
        name: "2801", "2803" or "5801".
        weight_formats: mask bits -> (weight register bits Bw, bias register bits Bb).
        input_sizes: accepted square input sizes in pixels.
        min_channels / max_channels: channel limits of every conv (powers of 2 only).
        max_major_layers / max_sublayers: structure limits.
        max_output_channels: output channels of the last conv.
        max_layer_io: per layer, input + output feature maps (channels x height x width each, the
            output after its pool) at most this many values; None: no limit stated for the chip.
        max_coef_memory: per chip, the coefficient memory (sum over the convs of in x out channels / 4
            for 1- and 2-bit, / 2 for 3- and 5-bit, / 1 for 8- and 12-bit kernels) must be below this;
            None: no budget stated for the chip. Both from GTI's 5801 material (docs/chip.md, "Memory
            limits"); GTI's material for the 2801 and 2803 states neither.
    """
    name: str
    weight_formats: Dict[int, Tuple[int, int]]
    input_sizes: Tuple[int, ...] = (224, 448)
    min_channels: int = 16
    max_channels: int = 1024
    max_major_layers: int = 6
    max_sublayers: int = 12
    max_output_channels: int = 256
    max_layer_io: Optional[int] = None
    max_coef_memory: Optional[int] = None


CHIPS: Dict[str, ChipSpec] = {
    "2801": ChipSpec("2801", {1: (12, 12), 3: (12, 18)}),
    "2803": ChipSpec("2803", {2: (12, 12), 5: (12, 16), 12: (12, 20)}),
    "5801": ChipSpec("5801", {1: (8, 20), 3: (8, 20), 8: (8, 20)}, input_sizes=(224, 320, 448, 640),
                     min_channels=4, max_major_layers=7, max_layer_io=4_816_896, max_coef_memory=489_216),
}


def get_chip_spec(chip: str | int) -> ChipSpec:
    """Return the ChipSpec of ``chip`` ("2801", "2803", "5801").

    Raises:
        ChipSpecError: unknown chip, naming the known ones.
    """
    key = str(chip)
    if key not in CHIPS:
        raise ChipSpecError(f"unknown chip '{chip}': choose one of {', '.join(CHIPS)} (config field 'chip')")
    return CHIPS[key]


def register_bits(chip: str | int, weight_format: int) -> Tuple[int, int]:
    """(Bw, Bb) of ``weight_format`` on ``chip``.

    Raises:
        ChipSpecError: the chip has no such weight format.
    """
    spec = get_chip_spec(chip)
    if weight_format not in spec.weight_formats:
        raise ChipSpecError(f"chip {spec.name} has no {weight_format}-bit weight format; "
                            f"it has {sorted(spec.weight_formats)}")
    return spec.weight_formats[weight_format]
