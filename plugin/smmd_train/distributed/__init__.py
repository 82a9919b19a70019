"""The distributed room: processes and their groups. ``groups`` (process-group start-up for the deepspeed
launcher, torchrun, mpirun, srun or one process, and the ordered shutdown), ``launcher`` (the one builder
of deepspeed launcher command lines; ``python -m smmd_train.distributed.launcher`` for the shell
launchers), ``sequence_parallel`` (DeepSpeed Ulysses for HF models), ``preflight`` (what DeepSpeed will
compile, checked before any model exists), ``process_start`` / ``process_end`` (a process's start and end
without the cyclic garbage collector's passes).
"""

from ..moved import room_attribute


def __getattr__(name: str):
    return room_attribute(__name__, name)
