"""What ``launch/train.py`` is made of, in rooms on floors (a module imports its own room and lower
floors only; ``tests/test_structure.py`` holds it), lowest first:

* ``compat``: the inventory of the private upstream APIs the trainer reaches for; ``moved``: the
  modules that moved into rooms in 0.3.0, refused by their old names; ``loss_modules``: a user's own
  losses (``--loss_module``), imported before anything reads the loss registry;
* ``model`` (presets, AutoTP's split, the model built under ZeRO-3) and ``monitor`` (TensorBoard,
  ``metrics.jsonl``, the dashboards);
* ``distributed``: process groups for every launcher, the launcher command line, sequence
  parallelism, the compile preflight, a process's start and end;
* ``config`` (the command line, the typed run settings, the DeepSpeed config) and ``data`` (sources,
  packing, micro-batches, whether the loss will see a numeric target);
* ``components``: the loss reporter, held-out evaluation, the schedule, the non-finite step guard;
* ``checkpoint``: save and load, commits, universal checkpoints, resume, the experiment record, export;
* ``plan``: what a run will be, decided before any weight exists; ``run``: the run set up in one call
  and its train step;
* ``tools``: the memory planner, scaling sweeps, GGUF conversion, the dry run;
* ``train`` (the program) and ``commands`` (the console commands).

Each room's ``__init__.py`` names its modules. The small command-line helpers every package shares
(typed options, Markdown tables) live in ``smmd_cli``. Needs the ``train`` extra.
"""

from . import moved

moved.install()
