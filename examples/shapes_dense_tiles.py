"""The dense small-object case through tiles: each 448-px image of tools/make_shapes.py --dense cut
into 2 x 2 tiles (16 px overlap, so every 4-16 px shape lies whole in some tile), GNetDet-224 on the
tiles, the cards recipe with the log size head and one trained box slot, as the box sizes ask. tools/xml_2_txt.py on the whole images names the tiling; the model
is scored on the tiles during training and on the whole images with --stitch.

    python3 tools/make_shapes.py data/shapes_dense --dense
    python3 tools/tile_voc.py data/shapes_dense data/shapes_dense_tiles --tiles 2 --overlap 16 \\
        --classes circle,square,triangle
    python3 tools/xml_2_txt.py --config examples/shapes_dense_tiles.py
    python3 tools/run_pipeline.py --config examples/shapes_dense_tiles.py
    python3 tools/eval_voc.py checkpoint/step4/best.pth --config examples/shapes_dense_tiles.py --stitch
"""
from gnetmdk.config import BaseConfig, quantized_stages


class Config(BaseConfig):
    DEFAULT_STEP = 1
    DS_NAME = "shapes_dense_tiles"
    VOC_CLASSES = ["circle", "square", "triangle"]
    dataset_path = "data/shapes_dense_tiles"
    image_size = 224
    batch_size = 16
    num_workers = 0
    threads = 2
    eval_interval = 5
    max_detections = 100
    gnetdet = dict(
        width_mult=0.25,
        chip="5801",
        score_head="logit",   # the cards recipe (examples/cards.py), not tuned for this set
        score_offset=0.5,
        score_scale=10.0,
        l_class=1.0,
        # box sizes in log space (size = size_min ** (1 - output)), as tools/xml_2_txt.py asks when most
        # boxes span fewer than 4 output code steps: GTI's linear sizes step by cap / 31 of the image side
        # (8.8 px at 224 px for these 4-16 px boxes), the log head by the same factor at every size
        # (docs/pipeline.md; on the tiles step 4 went from 14-16 points below step 1 to 0.0-0.9 above it)
        size_head="log",
        l_noobj=0.05,
        l_range=1.0,
        box_slots=1,
        mask_bits=[8, 3, 3, 3, 3, 8],
    )
    per_step = {
        1: dict(learning_rate=2e-3, num_epochs=60, warmup_epochs=3, ema=True, ema_decay=0.995),
        **quantized_stages(),      # steps 2-4: the schedule every example shares (gnetmdk/config/recipe.py)
    }
