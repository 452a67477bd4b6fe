"""Reading image files: one decoder for every dataset, tool and check, and one error a user can act on.

Every image the project reads from a dataset goes through :func:`decode_image`: opencv's decoder, after
a check that the file is complete (:func:`image_complete`), because libjpeg and libpng accept some
truncated files and return a partly grey image instead of an error.
"""
from __future__ import annotations

import os

import cv2
import numpy as np

__all__ = ["ImageReadError", "decode_image", "image_complete"]

cv2.setNumThreads(1)


class ImageReadError(OSError):
    """An image listed in a meta file cannot be read; the message names the file and the fix."""


def image_complete(data: bytes) -> bool:
    """Whether an encoded image's bytes reach the end of the image, for the formats whose decoders
    accept a truncated file without an error (libjpeg prints "Premature end of JPEG file" and returns
    an image whose missing part is grey; libpng's may fill rows): a JPEG must hold an end-of-image
    marker (FF D9) after its last start-of-scan marker (FF DA; entropy-coded data never holds FF
    followed by D9 or DA, ITU T.81 B.1.1.5), a PNG its IEND chunk. Other formats: True (their decoders
    refuse truncated files themselves)."""
    if data[:2] == b"\xff\xd8":
        sos = data.rfind(b"\xff\xda")
        return sos >= 0 and data.find(b"\xff\xd9", sos) >= 0
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return data.rfind(b"IEND") >= 0
    return True


def decode_image(path: str, fix: str = "replace or remove it and re-run tools/xml_2_txt.py") -> np.ndarray:
    """Read an image as uint8 BGR (H, W, 3); grayscale and 4-channel files become 3-channel BGR; the
    EXIF orientation is applied (opencv's default).

    Args:
        path: the image file.
        fix: what the error message tells the user to do (the caller's context).
    Raises:
        ImageReadError: missing, truncated (image_complete) or undecodable file; the message names it.
    """
    if not os.path.isfile(path):
        raise ImageReadError(f"image '{path}' does not exist: re-run tools/xml_2_txt.py or fix the meta file")
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise ImageReadError(f"image '{path}' cannot be read ({exc.strerror or exc}): {fix}") from None
    if not image_complete(data.tobytes()):
        raise ImageReadError(f"image '{path}' is truncated (the file ends before the image data does): {fix}")
    img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if img is None:
        raise ImageReadError(f"image '{path}' could not be decoded by opencv (not an image, or a format it lacks): "
                             f"{fix}")
    return img
