"""Hand-checked cases for the dense evaluator (language/semantics.py), which is the spec.

Expected matrices are written out from the table of docs/workloads.md / docs/design.md, not
computed by another implementation.
"""

from __future__ import annotations

import doctest

import pytest
import torch

from compilemask import masks as M
from compilemask.errors import CompileMaskError, LayoutError, LengthError
from compilemask.language import semantics
from compilemask.language.ast import Relation, Rule, RuleMask, Segment, Span
from compilemask.language.semantics import accepted_lengths, dense, visible


def mat(text: str) -> torch.Tensor:
    """A bool matrix from rows of 0/1 characters ('.' also means 0)."""
    rows = [r.strip() for r in text.strip().splitlines()]
    return torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)


def rules(layout, *rs) -> RuleMask:
    """RuleMask from ('name', lengths, grid) tuples and (q, k, relation) triples.

    A span is 'name', 'name[i]', 'name[2]' or a tuple of names; a relation is 'kind' or
    ('kind', params...)."""

    def span(s):
        if isinstance(s, tuple):
            return Span(s)
        if "[" in s:
            name, idx = s[:-1].split("[")
            return Span((name,), int(idx) if idx.isdigit() else idx)
        return Span((s,))

    def rel(r):
        return Relation(r) if isinstance(r, str) else Relation(r[0], tuple(r[1:]))

    segs = tuple(Segment(*s) for s in layout)
    return RuleMask(segs, tuple(Rule(span(q), span(k), rel(r)) for q, k, r in rs))


# ---------------------------------------------------------------- catalogue builtins


def test_causal_is_tril():
    assert torch.equal(dense(M.causal(), 7), torch.ones(7, 7, dtype=torch.bool).tril())


def test_causal_rectangular_is_top_left_aligned():
    assert torch.equal(dense(M.causal(), 3, 5), torch.ones(3, 5, dtype=torch.bool).tril())
    assert torch.equal(dense(M.causal(), 5, 3), torch.ones(5, 3, dtype=torch.bool).tril())


def test_sliding_window():
    expected = mat("""
        1....
        11...
        111..
        .111.
        ..111
    """)
    d = dense(M.sliding_window(3), 5)
    assert torch.equal(d, expected)
    assert torch.equal(dense(M.sliding_window(1), 4), torch.eye(4, dtype=torch.bool))
    # every row sees min(q + 1, window) keys
    counts = dense(M.sliding_window(4), 10).sum(1)
    assert counts.tolist() == [min(q + 1, 4) for q in range(10)]


def test_document():
    expected = mat("""
        1.....
        11....
        ..1...
        ..11..
        ..111.
        .....1
    """)
    assert torch.equal(dense(M.document([2, 3, 1]), 6), expected)
    expected_bidir = mat("""
        11....
        11....
        ..111.
        ..111.
        ..111.
        .....1
    """)
    assert torch.equal(dense(M.document([2, 3, 1], causal=False), 6), expected_bidir)


def test_prefix_lm():
    expected = mat("""
        11...
        11...
        111..
        1111.
        11111
    """)
    assert torch.equal(dense(M.prefix_lm(2), 5), expected)
    assert dense(M.prefix_lm(9), 4).all()  # prefix longer than the axis: all visible
    assert torch.equal(dense(M.prefix_lm(0), 4), dense(M.causal(), 4))


def test_chunked():
    expected = mat("""
        1.....
        11....
        ..1...
        ..11..
        ....1.
        ....11
    """)
    assert torch.equal(dense(M.chunked(2), 6), expected)


def test_block_causal():
    expected = mat("""
        11....
        11....
        1111..
        1111..
        111111
    """)
    assert torch.equal(dense(M.block_causal(2), 5, 6), expected)


def test_shared_prompt_one_group():
    # [P P | R0 R0 | R1 R1 R1]
    expected = mat("""
        1......
        11.....
        111....
        1111...
        11..1..
        11..11.
        11..111
    """)
    assert torch.equal(dense(M.shared_prompt(2, [2, 3]), 7), expected)


def test_shared_prompt_two_groups_and_empty_prompt():
    # group 0: [P | R0 | R1], group 1: [R2 R2] with no prompt
    expected = mat("""
        1....
        11...
        1.1..
        ...1.
        ...11
    """)
    assert torch.equal(dense(M.shared_prompt([1, 0], [[1, 1], [2]]), 5), expected)


def test_hstu():
    # one user of 6: history [0, 4), targets 4 and 5, contextual rows 0 and 1
    expected = mat("""
        1111..
        1111..
        111...
        1111..
        11111.
        1111.1
    """)
    assert torch.equal(dense(M.hstu([6], [2], contextual=2), 6), expected)


def test_hstu_two_users_no_context():
    # user 0: [h h t], user 1: [h h]
    expected = mat("""
        1....
        11...
        111..
        ...1.
        ...11
    """)
    assert torch.equal(dense(M.hstu([3, 2], [1, 0]), 5), expected)


def test_hstu_contextual_clipped_to_history():
    # history of 2 tokens, contextual=5 -> both history rows see the whole history
    expected = mat("""
        11.
        11.
        111
    """)
    assert torch.equal(dense(M.hstu([3], [1], contextual=5), 3), expected)


def test_clear():
    # 1 text token, then a 3 x 3 grid; radius 2: dy^2 + dx^2 < 4 holds for the 8 neighbours
    # (1 + 1 = 2) but not at distance 2 (4 is not < 4: strict).
    d = dense(M.clear((3, 3), 2, 1), 10)
    assert d[0].all() and d[:, 0].all()  # text row and text column
    centre = d[1 + 4, 1:].view(3, 3)  # image token (1, 1)
    assert centre.all()
    corner = d[1 + 0, 1:].view(3, 3)  # image token (0, 0)
    assert torch.equal(corner, mat("110\n110\n000"))
    # radius 3: (2, 0) has 4 < 9, (2, 2) has 8 < 9 -> every cell
    assert dense(M.clear((3, 3), 3, 0), 9).all()


def test_global_local():
    expected = mat("""
        11.1..
        1111..
        .111..
        111111
        ...111
        ...111
    """)
    assert torch.equal(dense(M.global_local(1, [3]), 6), expected)
    assert torch.equal(dense(M.global_local(0, []), 3), torch.eye(3, dtype=torch.bool))


def test_tree_three_nodes():
    # node 0 root, nodes 1 and 2 children of 0; prefix of 2 keys
    expected = mat("""
        111..
        1111.
        111.1
    """)
    assert torch.equal(dense(M.tree([-1, 0, 0], prefix_len=2), 3), expected)


def test_tree_chain_and_forest():
    # chain 0 <- 1 <- 2 is causal over the nodes; forest of two roots: each sees itself only
    assert torch.equal(dense(M.tree([-1, 0, 1], 0), 3), dense(M.causal(), 3))
    assert torch.equal(dense(M.tree([-1, -1], 1), 2), mat("11.\n1.1"))


def test_natten2d_corner_and_centre_rows():
    d = dense(M.natten2d((5, 5), (3, 3)), 25)
    # corner (0, 0): the window shifts inward to rows 0..2, cols 0..2
    assert torch.equal(d[0].view(5, 5), mat("11100\n11100\n11100\n00000\n00000"))
    # (0, 4): rows 0..2, cols 2..4
    assert torch.equal(d[4].view(5, 5), mat("00111\n00111\n00111\n00000\n00000"))
    # centre (2, 2): rows 1..3, cols 1..3
    assert torch.equal(d[12].view(5, 5), mat("00000\n01110\n01110\n01110\n00000"))
    assert (d.sum(1) == 9).all()  # every query sees a full 3 x 3 window


def test_natten2d_rectangular_kernel():
    d = dense(M.natten2d((3, 4), (1, 3)), 12)
    # (1, 3): row 1 only, cols 1..3
    assert torch.equal(d[1 * 4 + 3].view(3, 4), mat("0000\n0111\n0000"))


def test_dilated():
    expected = mat("""
        1.1..
        .1.1.
        1.1.1
        .1.1.
        ..1.1
    """)
    assert torch.equal(dense(M.dilated(2, 2), 5), expected)
    assert torch.equal(dense(M.dilated(0, 3), 4), torch.eye(4, dtype=torch.bool))


# ---------------------------------------------------------------- combinations


def test_combine_union_intersection_difference():
    a, b = M.causal(), M.dilated(1, 1)  # dilated(1, 1) = tridiagonal band
    da, db = dense(a, 5), dense(b, 5)
    assert torch.equal(dense(a | b, 5), da | db)
    assert torch.equal(dense(a & b, 5), da & db)
    assert torch.equal(dense(a - b, 5), da & ~db)
    # causal - sliding_window(2) leaves keys at distance >= 2
    assert torch.equal(dense(a - M.sliding_window(2), 4), mat("....\n....\n1...\n11.."))


def test_combine_takes_the_fixed_length_of_a_child():
    m = M.document([2, 2]) | M.causal()
    assert accepted_lengths(m, 4) == (4, 4)
    assert torch.equal(dense(m, 4), dense(M.causal(), 4))


def test_per_head_shape_and_selection():
    m = M.per_head([M.causal(), M.dilated(0, 1), M.prefix_lm(2)])
    d = dense(m, 4, heads=3)
    assert d.shape == (1, 3, 4, 4) and d.dtype == torch.bool
    for h, child in enumerate(m.masks):
        assert torch.equal(d[0, h], dense(child, 4))
    assert dense(m, 4).shape == (1, 3, 4, 4)  # heads=None: the mask's own count
    with pytest.raises(CompileMaskError, match="heads"):
        dense(m, 4, heads=2)


def test_per_batch_and_per_head_together():
    m = M.per_batch([M.causal(), M.dilated(0, 1)]) & M.per_head([M.dilated(1, 1)] * 3)
    d = dense(m, 4, batch=2, heads=3)
    assert d.shape == (2, 3, 4, 4)
    band = dense(M.dilated(1, 1), 4)
    assert torch.equal(d[0, 2], dense(M.causal(), 4) & band)
    assert torch.equal(d[1, 0], torch.eye(4, dtype=torch.bool))
    assert dense(M.per_batch([M.causal(), M.causal()]), 3, heads=8).shape == (2, 1, 3, 3)


def test_shared_mask_ignores_batch_and_heads():
    assert dense(M.causal(), 3, batch=4, heads=2).shape == (3, 3)


# ---------------------------------------------------------------- visible


def test_visible_broadcasts_and_is_false_outside():
    q = torch.tensor([[0], [2], [5]])
    k = torch.tensor([-1, 0, 1, 2, 3])
    v = visible(M.causal(), q, k, q_len=3, kv_len=3)
    assert v.shape == (3, 5)
    assert v.tolist() == [
        [False, True, False, False, False],
        [False, True, True, True, False],
        [False] * 5,  # q = 5 is not a row
    ]
    assert visible(M.causal(), 2, 1, q_len=3).item() is True


def test_visible_selects_head_and_batch():
    m = M.per_head([M.causal(), M.dilated(0, 1)])
    assert bool(visible(m, 2, 1, q_len=3, h=0)) and not bool(visible(m, 2, 1, q_len=3, h=1))
    with pytest.raises(CompileMaskError, match="head"):
        visible(m, 2, 1, q_len=3, h=2)
    pb = M.per_batch([M.causal(), M.dilated(0, 1)])
    assert not bool(visible(pb, 2, 1, q_len=3, b=1))


# ---------------------------------------------------------------- lengths


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", None])
def test_bad_q_len(bad):
    with pytest.raises(CompileMaskError, match="q_len"):
        accepted_lengths(M.causal(), bad)


@pytest.mark.parametrize("bad", [0, 3.0, False])
def test_bad_kv_len(bad):
    with pytest.raises(CompileMaskError, match="kv_len"):
        accepted_lengths(M.causal(), 4, bad)


def test_default_kv_len():
    assert accepted_lengths(M.causal(), 5) == (5, 5)
    assert accepted_lengths(M.causal(), 5, 7) == (5, 7)
    assert accepted_lengths(M.document([2, 3]), 5) == (5, 5)
    assert accepted_lengths(M.tree([-1, 0], 3), 2) == (2, 5)
    assert accepted_lengths(M.clear((2, 3), 1, 4), 10) == (10, 10)


@pytest.mark.parametrize(
    ("mask", "fixed"),
    [
        (M.document([2, 3]), 5),
        (M.shared_prompt([1, 2], [[1], [2, 1]]), 7),
        (M.hstu([3, 4], [1, 1]), 7),
        (M.clear((2, 3), 1, 4), 10),
        (M.natten2d((3, 4), (3, 3)), 12),
        (rules([("a", (2,)), ("b", (3,))], ("*", "*", "full")), 5),
    ],
)
def test_length_fixing_masks(mask, fixed):
    assert accepted_lengths(mask, fixed) == (fixed, fixed)
    for q_len, kv_len in [(fixed + 1, None), (fixed, fixed + 1), (fixed - 1, fixed)]:
        with pytest.raises(LengthError, match=f"{fixed}"):
            accepted_lengths(mask, q_len, kv_len)


def test_tree_lengths():
    t = M.tree([-1, 0, 0], 4)
    with pytest.raises(LengthError, match="q_len=3"):
        accepted_lengths(t, 2)
    with pytest.raises(LengthError, match="kv_len=7"):
        accepted_lengths(t, 3, 6)


def test_global_local_token_outside_axis():
    assert accepted_lengths(M.global_local(1, [4]), 3, 5) == (3, 5)
    with pytest.raises(LengthError, match="global"):
        accepted_lengths(M.global_local(1, [5]), 3, 5)


def test_combined_children_must_agree():
    with pytest.raises(LengthError, match="different key lengths"):
        accepted_lengths(M.document([2, 3]) | M.document([4]), 4)
    with pytest.raises(LengthError, match="part 1"):
        accepted_lengths(M.per_head([M.causal(), M.document([4])]), 5)
    with pytest.raises(LengthError):
        accepted_lengths(M.per_batch([M.tree([-1], 2), M.causal()]), 1, 4)


def test_open_layout_needs_room():
    m = rules([("p", (3,)), ("rest", None)], ("*", "*", "causal"))
    assert accepted_lengths(m, 3) == (3, 3)  # rest may be empty
    with pytest.raises(LengthError):
        accepted_lengths(m, 2)


# ---------------------------------------------------------------- rule masks and relations


def test_rule_causal_on_star_is_causal():
    m = rules([("rest", None)], ("*", "*", "causal"))
    assert torch.equal(dense(m, 6), dense(M.causal(), 6))
    assert torch.equal(dense(m, 3, 5), dense(M.causal(), 3, 5))


def test_shared_prompt_as_rules_matches_builtin():
    m = rules(
        [("prompt", (2,)), ("resp", (2, 3))],
        ("prompt", "prompt", "causal"),
        ("resp[i]", "prompt", "full"),
        ("resp[i]", "resp[i]", "causal"),
    )
    assert torch.equal(dense(m, 7), dense(M.shared_prompt(2, [2, 3]), 7))


def test_relations_on_one_span():
    lay = [("x", (5,))]
    cases = {
        "full": torch.ones(5, 5, dtype=torch.bool),
        "causal": torch.ones(5, 5, dtype=torch.bool).tril(),
        "diag": torch.eye(5, dtype=torch.bool),
        ("band", -1, 0): mat("1....\n11...\n.11..\n..11.\n...11"),
        ("band", 1, 2): mat(".11..\n..11.\n...11\n....1\n....."),
        ("chunk", 2): mat("11...\n11...\n..11.\n..11.\n....1"),
    }
    for rel, expected in cases.items():
        assert torch.equal(dense(rules(lay, ("x", "x", rel)), 5), expected), rel


def test_relations_are_relative_to_span_starts():
    # q in b = [2, 5), k in a = [0, 2) ... diag pairs q' = k'
    m = rules([("a", (2,)), ("b", (3,))], ("b", "a", "diag"))
    expected = mat(".....\n.....\n1....\n.1...\n.....")
    assert torch.equal(dense(m, 5), expected)
    m = rules([("a", (2,)), ("b", (3,))], ("a", "b", "causal"))
    assert torch.equal(dense(m, 5), mat("..1..\n..11.\n.....\n.....\n....."))


def test_indexed_pairing_and_literal_index():
    lay = [("d", (2, 2))]
    m = rules(lay, ("d[i]", "d[i]", "full"))
    assert torch.equal(dense(m, 4), dense(M.document([2, 2], causal=False), 4))
    m = rules(lay, ("d[1]", "d[0]", "diag"))
    assert torch.equal(dense(m, 4), mat("....\n....\n1...\n.1.."))
    # without a shared variable every part pairs with every range
    m = rules(lay, ("d[i]", "d", "full"))
    assert dense(m, 4).all()


def test_rule_mask_union_and_multi_name_span():
    m = rules(
        [("a", (1,)), ("b", (2,)), ("c", (1,))],
        (("a", "c"), ("a", "c"), "full"),  # two separate ranges: only full may use them
        ("b", "b", "diag"),
    )
    assert torch.equal(dense(m, 4), mat("1..1\n.1..\n..1.\n1..1"))


def test_rows_and_keys_beyond_lengths_do_not_exist():
    m = rules([("rest", None)], ("*", "*", "full"))
    assert dense(m, 2, 5).shape == (2, 5) and dense(m, 2, 5).all()


def test_grid_relations():
    lay = [("t", (1,)), ("img", (9,), (3, 3))]
    centre, corner = 1 + 4, 1 + 0
    d = dense(rules(lay, ("img", "img", ("disc", 2))), 10)
    assert d[centre, 1:].all() and not d[0].any() and not d[:, 0].any()
    assert torch.equal(d[corner, 1:].view(3, 3), mat("110\n110\n000"))
    d = dense(rules(lay, ("img", "img", ("box", 1, 3))), 10)
    assert torch.equal(d[corner, 1:].view(3, 3), mat("110\n000\n000"))
    assert torch.equal(d[centre, 1:].view(3, 3), mat("000\n111\n000"))
    d = dense(rules(lay, ("img", "img", ("natten", 1, 3))), 10)
    assert torch.equal(d[corner, 1:].view(3, 3), mat("111\n000\n000"))  # shifted inward
    # natten over a whole grid equals natten2d
    nat = rules([("g", (20,), (4, 5))], ("g", "g", ("natten", 3, 3)))
    assert torch.equal(dense(nat, 20), dense(M.natten2d((4, 5), (3, 3)), 20))


def test_clear_as_rules_matches_builtin():
    m = rules(
        [("text", (2,)), ("img", (12,), (3, 4))],
        ("text", "*", "full"),
        ("*", "text", "full"),
        ("img", "img", ("disc", 2)),
    )
    assert torch.equal(dense(m, 14), dense(M.clear((3, 4), 2, 2), 14))


def test_rule_layout_errors():
    with pytest.raises(LayoutError, match="contiguous"):
        dense(rules([("a", (1,)), ("b", (1,)), ("c", (1,))], (("a", "c"), "b", "causal")), 3)
    with pytest.raises(LayoutError, match="equal length"):
        dense(rules([("d", (2, 3)), ("e", (3, 2))], ("d[i]", "e[i]", "causal")), 10)
    # the same pairing is fine for full
    assert dense(rules([("d", (2, 3)), ("e", (3, 2))], ("d[i]", "e[i]", "full")), 10).sum() == 12
    with pytest.raises(LayoutError, match="parts"):
        dense(rules([("d", (2, 3)), ("e", (5,))], ("d[i]", "e[i]", "full")), 10)
    with pytest.raises(LayoutError, match="grid"):
        dense(rules([("x", (4,))], ("x", "x", ("disc", 2))), 4)
    with pytest.raises(LayoutError, match="grid"):
        dense(rules([("x", (4,), (2, 2)), ("y", (4,), (1, 4))], ("x", "y", ("box", 1, 1))), 8)
    with pytest.raises(LayoutError, match="larger"):
        dense(rules([("x", (4,), (2, 2))], ("x", "x", ("natten", 3, 1))), 4)


def test_docstring_examples():
    result = doctest.testmod(semantics, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
