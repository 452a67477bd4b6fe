"""Datasets: VOC and COCO annotations, meta files, image decoding (image_io.py), GNetDet's data
pipeline (dataset.py) and PP-YOLO's (ppyolo_dataset.py, ppyolo_transforms.py), the synthetic shapes
set and tiling."""
