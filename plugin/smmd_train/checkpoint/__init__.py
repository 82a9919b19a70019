"""The checkpoint room: runs that resume exactly. ``saving`` (save, load and the train state; the
conversion command, ``python -m smmd_train.checkpoint convert OUTPUT_DIR [TAG]``), ``commits`` (which
checkpoints are committed), ``universal`` (resumed under another layout), ``resume`` (an output dir
resumed, refused or overwritten), ``experiment`` (what a checkpoint was trained on, so a resume cannot
change it), ``export`` (a Hugging Face folder that ``from_pretrained`` loads).
"""

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
