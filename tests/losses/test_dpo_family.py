"""The DPO family's one argument block (tunelib/losses/_dpo_family.py) in each loss's help."""

import inspect

import pytest

from tunelib import losses
from tunelib.losses import _dpo_family

FAMILY = (
    losses.dpo_loss,
    losses.robust_dpo_loss,
    losses.length_normalized_dpo_loss,
    losses.ipo_loss,
    losses.hinge_loss,
    losses.exo_loss,
    losses.discopop_loss,
    losses.nca_loss,
    losses.bco_pair_loss,
    losses.sppo_hard_loss,
    losses.apo_zero_loss,
    losses.apo_down_loss,
    losses.aot_loss,
    losses.f_dpo_loss,
)


def args_entries(doc):
    """The Args section of `doc` as {name: the entry's text, its lines joined}."""
    section = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    indent = len(section[0]) - len(section[0].lstrip())
    entries = {}
    for line in section:
        if not line[indent].isspace():
            name = line[indent:].split(":", 1)[0]
            entries[name] = []
        entries[name].append(line.strip())
    return {name: " ".join(lines) for name, lines in entries.items()}


def shared_entry(name):
    return " ".join(line.strip() for line in _dpo_family.PAIR_ARGUMENTS[name])


@pytest.mark.parametrize("fn", FAMILY, ids=lambda fn: fn.__name__)
def test_help_documents_every_argument_in_the_signature_order(fn):
    assert list(args_entries(fn.__doc__)) == list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("fn", FAMILY, ids=lambda fn: fn.__name__)
def test_the_pair_arguments_are_the_family_entries(fn):
    entries = args_entries(fn.__doc__)
    for name in _dpo_family.PAIR:
        assert entries[name] == shared_entry(name)


def test_the_family_block_documents_the_four_log_probs_and_the_mask():
    assert list(_dpo_family.PAIR_ARGUMENTS) == [*_dpo_family.PAIR, "where"]
    assert shared_entry("where").startswith("where: `[B]` mask, True (or 1) = counts.")


def test_a_loss_keeps_its_own_entry_of_a_shared_argument():
    entries = args_entries(losses.aot_loss.__doc__)
    assert "take no part in the sort" in entries["where"]
    assert args_entries(losses.dpo_loss.__doc__)["where"] == shared_entry("where")


def test_an_entry_for_an_argument_the_function_lacks_is_an_error():
    def loss(chosen_logps, *, beta=0.1):
        """A loss.

        Args:
          beta: the strength.
          gamma: not an argument.

        Returns:
          Nothing.
        """

    with pytest.raises(TypeError, match="gamma"):
        _dpo_family.with_pair_arguments(loss)


def test_only_the_args_section_changes():
    def loss(chosen_logps, *, beta=0.1, where=None):
        """A loss.

        Args:
          beta: the strength,
            on two lines.

        Returns:
          Nothing.
        """

    original = loss.__doc__
    doc = _dpo_family.with_pair_arguments(loss).__doc__
    assert doc.split("Args:\n")[0] == original.split("Args:\n")[0]
    assert doc.endswith("\n\n        Returns:\n          Nothing.\n        ")
    assert args_entries(doc) == {
        "chosen_logps": shared_entry("chosen_logps"),
        "beta": "beta: the strength, on two lines.",
        "where": shared_entry("where"),
    }
