"""``python -m smmd_train.checkpoint convert OUTPUT_DIR [TAG]``: the conversion command of
:mod:`smmd_train.checkpoint.saving`."""

from .saving import main

if __name__ == "__main__":
    main()
