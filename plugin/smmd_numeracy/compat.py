"""The numeracy study's inventory of upstream workarounds and private APIs (mathematics_dataset): every
one ``smmd_numeracy`` uses is here and nowhere else, each checked against a named version
(``tests/numeracy/test_tier_b.py`` exercises them against the installed one)."""

from __future__ import annotations

import sys

from smmd_scale.compat import private


def arithmetic_modules():
    """The package's ``arithmetic`` module and its ``generate_settings`` module (the length limits).

    mathematics_dataset 1.0.1 (the registry's latest, 2019) imports ``base_solution_linear`` from
    ``sympy.solvers.diophantine``, where sympy >= 1.6 no longer exports it (it lives in the
    ``diophantine.diophantine`` submodule; fixed upstream in google-deepmind/mathematics_dataset#19,
    never released). The arithmetic problems do not use it; it is re-exported before the import so
    the package loads with the sympy torch needs."""
    diophantine = sys.modules.get("sympy.solvers.diophantine")
    if diophantine is None:
        import sympy.solvers.diophantine  # noqa: F401  (the package; its attribute is a function)

        diophantine = sys.modules["sympy.solvers.diophantine"]
    if not hasattr(diophantine, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        diophantine.base_solution_linear = base_solution_linear
    from mathematics_dataset import generate_settings
    from mathematics_dataset.modules import arithmetic

    return arithmetic, generate_settings


def training_entropy(level: int, levels: int):
    """The entropy range of training level ``level`` of ``levels``, for ``arithmetic.train``: the
    package's own split of its training entropy (``generate._make_entropy_fn``, which its public
    generator applies only while writing files). Checked against mathematics_dataset 1.0.1."""
    arithmetic_modules()
    from mathematics_dataset import generate

    return private(generate, "_make_entropy_fn", package="mathematics_dataset", checked="1.0.1",
                   purpose="draw Tier B's training problems at the package's own entropy levels")(level, levels)
