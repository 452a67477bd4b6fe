"""The chip side: chip-model file, converter, bit-exact integer emulator, ONNX export, host decode, checks.

    from gnetmdk.chip import convert_checkpoint, ChipEmulator, load_chip_model
    chip_model, step4_model = convert_checkpoint("checkpoint/step4/best.pth")
    codes = ChipEmulator(chip_model).run(images_u8_nhwc)      # (N, C_out, 14, 14) uint8 codes 0..31

See docs/chip.md for the file formats and the integer semantics ("What the chip computes").
"""
from .model_file import (FORMAT, VERSION, ChipLayer, ChipModel, ChipModelError, chip_model_from_dict,
                         load_chip_model)
from .convert import (ConversionError, check_checkpoint_for_chip, chip_model_from_gnetdet, convert_checkpoint,
                      padded_output_channels)
from .emulator import ChipEmulator, emulate, images_to_codes, rounding_shift
from .host import codes_to_predictions, decode_predictions, evaluate_chip, iter_dataset_batches
from .check import CheckReport, check_bit_exact, model_layer_codes

__all__ = ["FORMAT", "VERSION", "ChipLayer", "ChipModel", "ChipModelError", "chip_model_from_dict", "load_chip_model",
           "ConversionError", "check_checkpoint_for_chip", "chip_model_from_gnetdet", "convert_checkpoint",
           "padded_output_channels", "ChipEmulator", "emulate", "images_to_codes", "rounding_shift",
           "codes_to_predictions", "decode_predictions", "evaluate_chip", "iter_dataset_batches", "CheckReport",
           "check_bit_exact", "model_layer_codes"]
