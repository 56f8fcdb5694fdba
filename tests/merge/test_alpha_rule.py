"""The negation alpha rule of language tasks on synthetic validation curves, checked by hand."""

from __future__ import annotations

import pytest

from editkit.errors import ConfigError
from editkit.merge.coefficients import PerplexityNegationChoice, select_perplexity_negation_alpha

# theta_0's control perplexity 40: relative bound 1.05 x 40 = 42, absolute bound 40.5.
# Control rises with alpha; the target peaks at alpha 1 and again, beyond the bound, at 2.
CURVE = [  # (alpha, control ppl, target ppl)
    (0.0, 40.0, 600.0),
    (0.5, 40.4, 800.0),
    (1.0, 41.0, 1500.0),
    (1.5, 41.9, 1200.0),
    (2.0, 43.0, 5000.0),
]


def test_the_largest_target_within_the_relative_bound_even_when_a_larger_alpha_is_also_within():
    choice = select_perplexity_negation_alpha(CURVE, 40.0)
    assert choice == PerplexityNegationChoice(alpha=1.0, met=True, bound=pytest.approx(42.0), rule="relative",
                                              margin=0.05)


def test_the_absolute_rule_is_theta0_plus_half_a_perplexity_point():
    choice = select_perplexity_negation_alpha(CURVE, 40.0, rule="absolute")
    assert (choice.alpha, choice.met, choice.bound, choice.margin) == (0.5, True, 40.5, 0.5)


def test_relative_and_absolute_rules_differ_in_both_directions():
    """Above 10 ppl 5% is more than 0.5 ppl, below it is less."""
    high = [(0.5, 20.4, 100.0), (1.0, 20.9, 500.0)]  # bounds: relative 21, absolute 20.5
    assert select_perplexity_negation_alpha(high, 20.0, rule="relative").alpha == 1.0
    assert select_perplexity_negation_alpha(high, 20.0, rule="absolute").alpha == 0.5
    low = [(0.5, 5.2, 100.0), (1.0, 5.4, 500.0)]  # bounds: relative 5.25, absolute 5.5
    assert select_perplexity_negation_alpha(low, 5.0, rule="relative").alpha == 0.5
    assert select_perplexity_negation_alpha(low, 5.0, rule="absolute").alpha == 1.0


def test_a_margin_overrides_the_rules_default():
    choice = select_perplexity_negation_alpha(CURVE, 40.0, margin=0.1)  # bound 44: alpha 2 is allowed
    assert (choice.alpha, choice.bound, choice.margin) == (2.0, pytest.approx(44.0), 0.1)
    assert select_perplexity_negation_alpha(CURVE, 40.0, rule="absolute", margin=1.0).alpha == 1.0  # bound 41


def test_a_control_exactly_on_the_bound_is_kept():
    assert select_perplexity_negation_alpha([(0.5, 42.0, 900.0), (1.0, 42.1, 999.0)], 40.0).alpha == 0.5
    rounded_down = select_perplexity_negation_alpha([(0.5, 3.6, 9.0)], 3.0, margin=0.2)
    assert rounded_down.bound < 3.6 and rounded_down.met  # (1 + 0.2) x 3 is 3.5999999999999996 in floats


def test_a_rule_never_met_says_so_with_the_alpha_of_lowest_control_perplexity():
    rows = [(0.0, 40.0, 600.0), (0.5, 44.0, 700.0), (1.0, 43.0, 900.0), (1.5, 43.0, 950.0), (2.0, 47.0, 2000.0)]
    choice = select_perplexity_negation_alpha(rows, 40.0)
    # alpha 0 keeps the control but is theta_0 itself; 1.0 and 1.5 tie on control: the smaller wins
    assert (choice.alpha, choice.met, choice.bound) == (1.0, False, pytest.approx(42.0))


def test_equal_targets_go_to_the_lower_control_then_the_smaller_alpha():
    rows = [(0.5, 41.0, 900.0), (1.0, 40.5, 900.0), (1.5, 40.5, 900.0)]
    assert select_perplexity_negation_alpha(rows, 40.0).alpha == 1.0


@pytest.mark.parametrize(("rows", "options", "message"), [
    (CURVE, {"rule": "relatve"}, "^unknown alpha rule 'relatve'; known: absolute, relative$"),
    (CURVE, {"margin": -0.1}, "non-negative"),
    ([(0.0, 40.0, 600.0)], {}, "at least one alpha > 0"),
])
def test_bad_rules_margins_and_grids_are_refused(rows, options, message):
    with pytest.raises(ConfigError, match=message):
        select_perplexity_negation_alpha(rows, 40.0, **options)
