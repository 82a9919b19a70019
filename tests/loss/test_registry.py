import pytest
import torch

from smmd_scale import NTLoss, NumericVocab, SMMDLoss, WeightedNumericLosses
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss, parse_terms, statistic_names


def test_parse_terms_reads_weights_and_names_bad_entries():
    assert parse_terms("smmd:1 ntl-was:0.3") == [("smmd", 1.0), ("ntl-was", 0.3)]
    assert parse_terms(["ntl-mse"]) == [("ntl-mse", 1.0)]
    for bad, message in (("cross", r"'cross' is not one of smmd, ntl-was, ntl-mse"), ("smmd:x", "must be a number"),
                         ("smmd:-1", "finite number >= 0"), ("smmd:nan", "finite number >= 0"),
                         ("smmd smmd:2", "names each loss once"), ("", "at least one loss name")):
        with pytest.raises(ValueError, match=message):
            parse_terms(bad)
    # A near miss is named, as the flags' are: the underscore spelling of a name, a dropped letter.
    for typo, meant in (("ntl_was", "ntl-was"), ("smd:1", "smmd"), ("DEL", "del"), ("gauss-sl", "gauss-ls")):
        with pytest.raises(ValueError, match=f"; did you mean {meant}( or |\\?)"):
            parse_terms(typo)


def test_build_numeric_loss_passes_each_group_its_options():
    vocab = NumericVocab(list(range(10)), list(range(10)), 16)
    single = build_numeric_loss(vocab, [("smmd", 1.0)], {"smmd": {"sigmas": (3.0, )}, "ntl": {"reweigh": False}})
    assert isinstance(single, SMMDLoss) and single.sigmas == (3.0, )
    summed = build_numeric_loss(vocab, parse_terms("smmd:2 ntl-mse:0.5"), {"ntl": {"reweigh": False}})
    assert isinstance(summed, WeightedNumericLosses)
    (smmd, smmd_weight), (ntl, ntl_weight) = summed.weighted_terms()
    assert isinstance(smmd, SMMDLoss) and smmd_weight == 2.0
    assert isinstance(ntl, NTLoss) and ntl.kind == "mse" and ntl.reweigh is False and ntl_weight == 0.5


def test_every_entry_reports_the_statistic_it_registers():
    vocab = NumericVocab(list(range(10)), list(range(10)), 16)
    logits, targets = torch.randn(6, 16, dtype=torch.float64), torch.tensor([1, 2, 3, 11, -100, 9])
    from smmd_scale import numeric_cross_entropy

    for entry in NUMERIC_LOSSES.values():
        stats = numeric_cross_entropy(logits, targets, entry.build(vocab)).stats
        assert {entry.stat_name, *entry.parts} <= set(stats), entry.name
    assert set(statistic_names()) == {"smmd", "mmd", "smooth", "ntl_was", "ntl_mse", "ntl_number", "dist2", "gauss_ls",
                                      "del"}


def test_each_entry_says_what_its_class_says():
    """A loss's statistic names and its option defaults are written in its class and in its registry
    entry; this ties the two: the entry's stat_name and parts are the built loss's ``name`` and
    ``stat_names``, and each option's default is the class's keyword default."""
    import inspect

    from smmd_scale.registry import options_from

    vocab = NumericVocab(list(range(20, 30)), [float(value) for value in range(10)], 40)
    defaults = options_from(lambda option: option.default)
    checked = 0
    for entry in NUMERIC_LOSSES.values():
        loss = build_numeric_loss(vocab, [(entry.name, 1.0)], defaults, dot_token_ids=[13])
        assert (loss.name, loss.stat_names) == (entry.stat_name, (entry.stat_name, *entry.parts)), entry.name
        keywords = inspect.signature(type(loss).__init__).parameters
        for option in entry.options:
            declared = keywords[option.keyword].default
            assert option.keyword_value(option.default) == (tuple(declared) if option.several else declared), \
                (entry.name, option.keyword, option.default, declared)
            checked += 1
    assert checked >= 10  # (every entry's options: SMMD 4, NTL 2 twice and 1 twice, DIST2 2, Gaussian LS 1, DEL 2)


def _toy_entry(name="toy-abs", stat_name="toy_abs", group="toy", flag="--toy_scale"):
    from smmd_scale.registry import LossOption, NumericLossEntry

    return NumericLossEntry(name, stat_name, (), group, SMMDLoss, "a toy", options=(
        LossOption("scale", flag, float, 1.0, "the toy's scale"), ))


def test_a_user_registers_a_loss_of_their_own_and_a_bad_or_late_entry_is_refused(monkeypatch):
    """``register_numeric_loss`` (what a ``--loss_module`` calls; tests/launch/test_loss_module.py runs
    one through train.py): the table takes a new entry, refuses one that takes another's name,
    statistic, option group or flag, and refuses any entry once a module has copied the table."""
    from smmd_scale import registry

    monkeypatch.setattr(registry, "NUMERIC_LOSSES", dict(NUMERIC_LOSSES))
    monkeypatch.setattr(registry, "_READERS", [])
    for entry, message in ((_toy_entry(name="smmd"), "smmd is taken by loss 'smmd'"),
                           (_toy_entry(stat_name="ntl_was"), "ntl_was is taken by loss 'ntl-was'"),
                           (_toy_entry(stat_name="mmd"), "mmd is taken by loss 'smmd'"),
                           (_toy_entry(group="ntl"), "option group 'ntl' is another loss's"),
                           (_toy_entry(flag="--smmd_sigmas"), "flag --smmd_sigmas is another loss's option"),
                           (_toy_entry(name="toy abs"), "must be words of letters and digits"),
                           (_toy_entry(stat_name="toy-abs"), "must be an identifier")):
        with pytest.raises(ValueError, match=message):
            registry.register_numeric_loss(entry)
    with pytest.raises(TypeError, match="takes a smmd_scale.registry.NumericLossEntry"):
        registry.register_numeric_loss(("toy-abs", "toy_abs"))
    assert registry.register_numeric_loss(_toy_entry()) is registry.NUMERIC_LOSSES["toy-abs"]
    assert parse_terms("smmd toy-abs:0.5") == [("smmd", 1.0), ("toy-abs", 0.5)]
    assert "--toy_scale" in [option.flag for option in registry.all_options()]
    assert "toy_abs" in registry.statistic_names()
    registry.note_reader("smmd_train.monitor.training")
    with pytest.raises(RuntimeError, match=r"'toy-two' registered after smmd_train\.monitor\.training copied the "
                                           r"registry.*--loss_module MODULE"):
        registry.register_numeric_loss(_toy_entry("toy-two", "toy_two", "toy2", "--toy_two"))


def test_a_loss_that_moved_to_a_module_of_its_own_is_refused_by_its_old_path():
    import smmd_scale
    from smmd_scale.dist2 import DIST2Loss
    from smmd_scale.gauss_ls import GaussianLabelSmoothingLoss

    assert smmd_scale.DIST2Loss is DIST2Loss and smmd_scale.GaussianLabelSmoothingLoss is GaussianLabelSmoothingLoss
    for name, module in (("DIST2Loss", "smmd_scale.dist2"), ("GaussianLabelSmoothingLoss", "smmd_scale.gauss_ls")):
        with pytest.raises(ImportError, match=f"^{name} moved to {module} in smmd-scale 0.3.0"):
            exec(f"from smmd_scale.soft_target import {name}", {})
