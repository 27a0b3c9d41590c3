"""The mutation check stays a check: every bug in tests/mutate.py still fits the code it mutates (each
snippet found exactly once), and each names tests that exist. Otherwise a refactor silently turns a
mutation into an error the next full run trips on, and the guarantee it stood for goes unchecked."""

import re

import mutate
import pytest


@pytest.mark.parametrize("name", sorted(mutate.MUTATIONS))
def test_each_mutation_still_fits_the_code_and_names_real_tests(name):
    mutate.mutated(name)  # raises SystemExit naming the stale snippet
    for test in mutate.MUTATIONS[name][3]:
        path, _, func = test.partition("::")  # a file alone: every test in it
        text = (mutate.ROOT / path).read_text()
        func = re.sub(r"\[.*\]$", "", func)
        assert not func or re.search(rf"^def {re.escape(func)}\(", text, re.M), f"{name}: no test {test}"


def test_the_fast_list_names_only_listed_mutations():
    assert set(mutate.FAST) <= set(mutate.MUTATIONS)
