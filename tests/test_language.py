"""The text syntax: printer, parser and Python builders agree on the IR (``parse(str(m)) == m``)."""

from __future__ import annotations

import inspect
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilemask import masks
from compilemask.errors import CompileMaskError, LayoutError, MaskSyntaxError
from compilemask.language.ast import (
    RELATION_ARITY,
    Builtin,
    Combine,
    PerBatch,
    PerHead,
    Relation,
    Rule,
    RuleMask,
    Segment,
    Span,
)
from compilemask.language.builders import grid, regions, rule, seg
from compilemask.language.parser import parse, parse_layout, parse_relation, parse_span
from compilemask.language.printer import to_text

# --- catalogue: a few parameter sets per constructor ----------------------------------------
CATALOGUE_CASES = {
    "causal": [()],
    "sliding_window": [(1,), (1024,)],
    "document": [([3, 5],), ([3, 5, 2], False), ([7], True)],
    "prefix_lm": [(0,), (2048,)],
    "chunked": [(1,), (64,)],
    "block_causal": [(128,)],
    "shared_prompt": [(1024, [500, 400]), (0, [3]), ([4, 2], [[1, 2], [3]]), ([4], [[1, 2]])],
    "hstu": [([10, 20], [2, 0]), ([5], [4], 3)],
    "clear": [((16, 32), 16, 512), ([2, 3], 1, 0)],
    "global_local": [(3, []), (0, [9, 0, 4])],
    "tree": [([-1, 0, 0, 1], 3), ([-1, -1], 0)],
    "natten2d": [((8, 8), (3, 5)), ([1, 1], [1, 1])],
    "dilated": [(0, 1), (8, 2)],
}
CATALOGUE_PARAMS = [
    pytest.param(name, args, id=f"{name}-{i}")
    for name, cases in CATALOGUE_CASES.items()
    for i, args in enumerate(cases)
]


def roundtrip(m):
    text = str(m)
    back = parse(text)
    assert back == m, text
    assert str(back) == text
    return text


def test_every_catalogue_constructor_has_cases():
    assert set(CATALOGUE_CASES) == set(masks.CATALOGUE)


@pytest.mark.parametrize("name,args", CATALOGUE_PARAMS)
def test_catalogue_roundtrip(name, args):
    m = masks.CATALOGUE[name](*args)
    text = roundtrip(m)
    assert text.startswith(f"{name}(")


def test_catalogue_texts():
    assert str(masks.causal()) == "causal()"
    assert str(masks.sliding_window(1024)) == "sliding_window(1024)"
    assert str(masks.document([3, 5])) == "document([3, 5])"
    assert str(masks.document([3, 5], causal=False)) == "document([3, 5], causal=false)"
    assert str(masks.hstu([5], [4], contextual=3)) == "hstu([5], [4], contextual=3)"
    text = "document([3, 5], causal=false) | causal()"
    assert str(parse(text)) == text
    assert str(parse("document([3, 5], false)")) == "document([3, 5], causal=false)"
    assert str(parse("hstu([5], [4], 0)")) == "hstu([5], [4])"
    tiled = masks.tile_grid(masks.clear((4, 6), 2, 3), (2, 3))
    assert roundtrip(tiled) == "tile_grid(clear([4, 6], 2, 3), [2, 3])"
    assert str(masks.shared_prompt(1024, [500, 400])) == "shared_prompt(1024, [500, 400])"
    assert str(masks.shared_prompt([4, 2], [[1], [2, 3]])) == "shared_prompt([4, 2], [[1], [2, 3]])"
    assert str(masks.tree([-1, 0], 3)) == "tree([-1, 0], 3)"


def test_keyword_and_tuple_arguments():
    assert parse("document([3,5], causal=false)") == masks.document([3, 5], causal=False)
    assert parse("tree(parents=[-1, 0, 0], prefix_len=3)") == masks.tree([-1, 0, 0], 3)
    assert parse("clear((16, 32), 16, text_len=512)") == masks.clear((16, 32), 16, 512)
    assert parse("natten2d([8,8], (3,3))") == masks.natten2d((8, 8), (3, 3))
    assert parse("global_local(2, [])") == masks.global_local(2, [])
    assert parse("hstu(\n  [10, 20],\n  [2, 0],  # targets\n)") == masks.hstu([10, 20], [2, 0])


# --- combinations and precedence ------------------------------------------------------------
A, B, C = masks.causal(), masks.sliding_window(4), masks.prefix_lm(2)


@pytest.mark.parametrize(
    "mask,text",
    [
        (A | B, "causal() | sliding_window(4)"),
        (A | B | C, "causal() | sliding_window(4) | prefix_lm(2)"),
        (A | (B | C), "causal() | (sliding_window(4) | prefix_lm(2))"),
        (A - B - C, "causal() - sliding_window(4) - prefix_lm(2)"),
        (A - (B - C), "causal() - (sliding_window(4) - prefix_lm(2))"),
        (A - (B | C), "causal() - (sliding_window(4) | prefix_lm(2))"),
        (A & B | C, "causal() & sliding_window(4) | prefix_lm(2)"),
        (A | B & C, "causal() | sliding_window(4) & prefix_lm(2)"),
        (A & (B | C), "causal() & (sliding_window(4) | prefix_lm(2))"),
        ((A | B) & C, "(causal() | sliding_window(4)) & prefix_lm(2)"),
        (A & (B & C), "causal() & (sliding_window(4) & prefix_lm(2))"),
        # parentheses the text grammar alone would not need, kept so Python reads it the same
        ((A - B) | C, "(causal() - sliding_window(4)) | prefix_lm(2)"),
        (A | (B - C), "causal() | (sliding_window(4) - prefix_lm(2))"),
        ((A | B) - C, "(causal() | sliding_window(4)) - prefix_lm(2)"),
        (A - (B & C), "causal() - (sliding_window(4) & prefix_lm(2))"),
        ((A & B) - C, "(causal() & sliding_window(4)) - prefix_lm(2)"),
        ((A - B) & C, "(causal() - sliding_window(4)) & prefix_lm(2)"),
    ],
)
def test_combine_parentheses(mask, text):
    assert str(mask) == text
    assert parse(text) == mask
    python_names = {n: getattr(masks, n) for n in ("causal", "sliding_window", "prefix_lm")}
    assert eval(text, python_names) == mask  # the text reads the same as Python


def test_precedence_when_parsing():
    assert parse("causal() | sliding_window(4) & prefix_lm(2)") == A | (B & C)
    assert parse("causal() - sliding_window(4) | prefix_lm(2)") == (A - B) | C
    assert parse("((causal()))") == A
    assert parse("causal()\n  | sliding_window(4)  # union\n") == A | B


def test_per_head_per_batch():
    ph = masks.per_head([A, B | C, A & B])
    assert str(ph) == (
        "per_head([causal(), sliding_window(4) | prefix_lm(2), causal() & sliding_window(4)])"
    )
    roundtrip(ph)
    roundtrip(masks.per_batch([masks.document([3, 5]), masks.document([8])]))
    roundtrip(masks.per_batch([ph, ph]) | A)
    assert parse("per_head([causal(),\n sliding_window(4),])") == PerHead((A, B))


# --- rule blocks ----------------------------------------------------------------------------
BLOCK = """
layout prompt:2048 resp:8x1792 doc:[3,5,2] image:grid(128,256) rest:*
prompt -> prompt : causal
resp[i] -> prompt : full
resp[i] -> resp[i] : causal
prompt|resp -> * : band(-128, 0)
doc[1] -> doc[0] : chunk(2)
doc[i] -> doc[i] : diag
image -> image : disc(16)
image -> image : box(3, 5)
image -> image : natten(7, 7)
rest -> * : full
"""


def test_block_parses_to_ir():
    m = parse(BLOCK)
    assert isinstance(m, RuleMask)
    assert m.layout == (
        Segment("prompt", (2048,)),
        Segment("resp", (1792,) * 8),
        Segment("doc", (3, 5, 2)),
        Segment("image", (128 * 256,), (128, 256)),
        Segment("rest", None),
    )
    assert m.rules[1] == Rule(Span(("resp",), "i"), Span(("prompt",)), Relation("full"))
    assert m.rules[3] == Rule(Span(("prompt", "resp")), Span(("*",)), Relation("band", (-128, 0)))
    assert m.rules[4].query == Span(("doc",), 1)
    assert {r.relation.kind for r in m.rules} == set(RELATION_ARITY)
    assert str(m) == BLOCK.strip()
    roundtrip(m)


def test_block_separators_and_comments():
    one = parse("layout a:4 b:2; a -> a : causal; b -> * : full()")
    many = parse("# header\nlayout a:4, b:2   # segments\n\n a -> a : causal() ;\n\nb->*:full\n")
    assert one == many
    assert str(one) == "layout a:4 b:2\na -> a : causal\nb -> * : full"


def test_nested_block_in_expression():
    block = parse("layout a:4 b:2; a -> a : causal; b -> * : full")
    m = parse("{ layout a:4 b:2\n a -> a : causal\n b -> * : full } & sliding_window(3) | causal()")
    assert m == (block & masks.sliding_window(3)) | A
    assert str(m) == (
        "{ layout a:4 b:2; a -> a : causal; b -> * : full } & sliding_window(3) | causal()"
    )
    roundtrip(m)
    roundtrip(masks.per_head([block, A]))


def test_empty_block_and_single_part_family():
    assert parse("layout a:*") == RuleMask((Segment("a", None),), ())
    # resp:1x5 and resp:[5] are the same segment as resp:5
    assert parse("layout r:1x5") == parse("layout r:[5]") == parse("layout r:5")


# --- builders -------------------------------------------------------------------------------
def test_builders_match_text():
    built = regions(
        [seg("prompt", 2048), seg("resp", [1792] * 8), grid("image", 4, 8), seg("rest", "*")],
        [
            rule("prompt", "prompt", "causal"),
            rule("resp[i]", "prompt"),
            rule(Span(("resp",), "i"), "resp[i]", Relation("band", (-128, 0))),
            rule("image", "image", "natten(3, 5)"),
            "prompt|rest -> * : chunk(4)",
        ],
    )
    text = """layout prompt:2048 resp:8x1792 image:grid(4,8) rest:*
prompt -> prompt : causal
resp[i] -> prompt : full
resp[i] -> resp[i] : band(-128, 0)
image -> image : natten(3, 5)
prompt|rest -> * : chunk(4)"""
    assert built == parse(text)
    assert str(built) == text
    assert regions("prompt:2048 resp:8x1792 image:grid(4,8) rest:*", built.rules) == built
    assert parse_layout("layout a:3") == (Segment("a", (3,)),)


def test_builder_errors():
    with pytest.raises(LayoutError, match="unknown span"):
        regions([seg("a", 4)], [rule("b", "a", "full")])
    with pytest.raises(LayoutError, match="identifier"):
        seg("not a name", 4)
    with pytest.raises(LayoutError):
        seg("a", -1)
    # zero-length parts are refused, as document([3, 0, 2]) refuses an empty document
    with pytest.raises(LayoutError, match="part 1 of segment 'a' has a bad length 0"):
        seg("a", [3, 0, 2])
    with pytest.raises(LayoutError, match="segment 'a' has a bad length 0"):
        seg("a", 0)
    with pytest.raises(LayoutError, match="used twice"):
        regions([seg("a", 4), seg("a", 2)], [])
    with pytest.raises(MaskSyntaxError, match="unknown relation"):
        rule("a", "a", "caual")
    with pytest.raises(LayoutError, match="not bound"):
        regions([seg("a", [2, 2])], [rule("a", "a[i]", "causal")])
    assert parse_span("*") == Span(("*",))
    assert parse_relation("box(3,3)") == Relation("box", (3, 3))


# --- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,message,line,column",
    [
        ("layout a:4\na a : full", "expected '->' after the query span", 2, 3),
        ("layout a:4\na -> a : caual", "unknown relation 'caual'", 2, 10),
        ("layout a:4\na -> a : band(1)", "takes 2 parameter", 2, 10),
        ("layout a:4\na -> a full", "expected ':' after the key span", 2, 8),
        ("sliding(3)", "unknown mask 'sliding'; known: ", 1, 1),
        ("causal() |", "expected a mask", 1, 11),
        ("causal() causal()", "after the mask", 1, 10),
        ("causal", "expected '('", 1, 7),
        ("layout a:4x", "bad number", 1, 10),
        ("layout a:\n", "expected a length for segment 'a'", 1, 10),
        ("causal() | layout a:4", "written in braces", 1, 12),
        ("{ layout a:4; a -> a : full", "expected '}'", 1, 28),
        ("document([3,5], causl=true)", "bad arguments for document(lengths, causal=true)", 1, 1),
        ("document(causal=true, [3])", "positional argument follows", 1, 23),
        ("causal() $ causal()", "unexpected character '$'", 1, 10),
        ("per_head(causal())", "expected '['", 1, 10),
    ],
)
def test_syntax_errors_show_position(text, message, line, column):
    with pytest.raises(MaskSyntaxError) as info:
        parse(text)
    err = info.value
    assert message in str(err)
    assert (err.line, err.column) == (line, column)
    lines = str(err).splitlines()
    assert f"(line {line}, column {column})" in lines[0]
    assert lines[-1] == "  " + " " * (column - 1) + "^"


@pytest.mark.parametrize(
    "text,error,message",
    [
        ("layout a:4 a:2", LayoutError, "used twice"),
        ("layout a:* b:*", LayoutError, "open-ended"),
        ("layout a:4\nb -> a : full", LayoutError, "unknown span 'b'"),
        ("layout a:4\na -> a : band(2, 1)", LayoutError, "lo <= hi"),
        ("layout a:4\na -> a : box(2, 3)", LayoutError, "odd"),
        ("layout a:4\na -> a : chunk(0)", LayoutError, "c >= 1"),
        ("layout a:[2,2]\na -> a[i] : full", LayoutError, "not bound"),
        ("layout a:[2,2] b:1\na|b[i] -> a : full", LayoutError, "single named span"),
        ("layout a:[]", MaskSyntaxError, "expected an integer"),
        ("layout a:0 b:*", LayoutError, "segment 'a' has a bad length 0 (need an int >= 1"),
        ("layout a:[3, 0, 2]", LayoutError, "part 1 of segment 'a' has a bad length 0"),
        ("layout a:2x0 b:*", LayoutError, "part 0 of segment 'a' has a bad length 0"),
        ("sliding_window(0)", CompileMaskError, "window must be >= 1"),
        ("tree([0], 1)", CompileMaskError, "parents[0]"),
        ("per_head([])", CompileMaskError, "non-empty"),
    ],
)
def test_semantic_errors_keep_type_and_show_position(text, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        parse(text)
    assert "line " in str(info.value) and "^" in str(info.value)


def test_parse_rejects_non_text():
    with pytest.raises(CompileMaskError):
        parse(b"causal()")  # type: ignore[arg-type]


# --- property: random IR round-trips ----------------------------------------------------------
pos = st.integers(1, 64)
nonneg = st.integers(0, 64)
ints_list = st.lists(pos, min_size=1, max_size=4)
odd = st.integers(0, 4).map(lambda n: 2 * n + 1)


@st.composite
def shared_prompts(draw):
    if draw(st.booleans()):
        return masks.shared_prompt(draw(nonneg), draw(ints_list))
    groups = draw(st.integers(1, 3))
    return masks.shared_prompt(
        draw(st.lists(nonneg, min_size=groups, max_size=groups)),
        draw(st.lists(ints_list, min_size=groups, max_size=groups)),
    )


@st.composite
def hstus(draw):
    lens = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
    targets = [draw(st.integers(0, n - 1)) for n in lens]
    return masks.hstu(lens, targets, draw(nonneg))


@st.composite
def trees(draw):
    n = draw(st.integers(1, 6))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    return masks.tree(parents, draw(nonneg))


@st.composite
def nattens(draw):
    g = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    k = tuple(draw(odd.filter(lambda v, e=e: v <= e)) for e in g)
    return masks.natten2d(g, k)


builtins = st.one_of(
    st.just(masks.causal()),
    st.builds(masks.sliding_window, pos),
    st.builds(masks.document, ints_list, st.booleans()),
    st.builds(masks.prefix_lm, nonneg),
    st.builds(masks.chunked, pos),
    st.builds(masks.block_causal, pos),
    shared_prompts(),
    hstus(),
    st.builds(masks.clear, st.tuples(pos, pos), pos, nonneg),
    st.builds(masks.global_local, nonneg, st.lists(nonneg, unique=True, max_size=4)),
    trees(),
    nattens(),
    st.builds(masks.dilated, nonneg, pos),
)

NAMES = ["a", "b", "resp", "doc", "image", "layout", "x1", "rest_2", "grid"]
signed = st.integers(-64, 64)


@st.composite
def relations(draw):
    kind = draw(st.sampled_from(sorted(RELATION_ARITY)))
    if kind == "band":
        lo, hi = sorted((draw(signed), draw(signed)))
        return Relation(kind, (lo, hi))
    if kind in ("chunk", "disc"):
        return Relation(kind, (draw(pos),))
    if kind in ("box", "natten"):
        return Relation(kind, (draw(odd), draw(odd)))
    return Relation(kind)


@st.composite
def segments(draw, name):
    shape = draw(st.sampled_from(["one", "repeat", "list", "open", "grid"]))
    if shape == "one":
        return Segment(name, (draw(pos),))
    if shape == "repeat":
        return Segment(name, (draw(pos),) * draw(st.integers(2, 5)))
    if shape == "list":
        return Segment(name, tuple(draw(st.lists(pos, min_size=2, max_size=5))))
    if shape == "open":
        return Segment(name, None)
    h, w = draw(pos), draw(pos)
    return Segment(name, (h * w,), (h, w))


@st.composite
def rule_masks(draw):
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    layout = []
    for n in names:
        s = draw(segments(n))
        if s.lengths is None and any(p.lengths is None for p in layout):
            s = Segment(n, (3,))
        layout.append(s)
    rules = []
    for _ in range(draw(st.integers(0, 4))):
        form = draw(st.sampled_from(["plain", "family", "literal"]))
        if form == "family":
            name = draw(st.sampled_from(names))
            var = draw(st.sampled_from(["i", "j", "user"]))
            q = Span((name,), var)
            k = draw(st.sampled_from([Span((name,), var), Span(("*",)), Span((names[0],))]))
        else:
            pick = st.lists(st.sampled_from([*names, "*"]), min_size=1, max_size=3, unique=True)
            q, k = Span(tuple(draw(pick))), Span(tuple(draw(pick)))
            if form == "literal":
                q = Span((draw(st.sampled_from(names)),), draw(st.integers(0, 5)))
        rules.append(Rule(q, k, draw(relations())))
    return RuleMask(tuple(layout), tuple(rules))


all_masks = st.recursive(
    st.one_of(builtins, rule_masks()),
    lambda inner: st.one_of(
        st.builds(Combine, st.sampled_from("|&-"), inner, inner),
        st.lists(inner, min_size=1, max_size=3).map(lambda ms: PerHead(tuple(ms))),
        st.lists(inner, min_size=1, max_size=3).map(lambda ms: PerBatch(tuple(ms))),
    ),
    max_leaves=6,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(builtins)
def test_property_builtin_roundtrip(m):
    assert isinstance(m, Builtin)
    roundtrip(m)


def _keyword_params(name):
    """The parameters of a catalogue constructor that have a default (printed as keywords)."""
    sig = inspect.signature(masks.CATALOGUE[name])
    return [p for p in sig.parameters.values() if p.default is not inspect.Parameter.empty]


#: a value other than the default for every catalogue parameter that has one
NON_DEFAULT = {("document", "causal"): False, ("hstu", "contextual"): 3}


def test_non_default_keyword_values_cover_the_catalogue():
    keywords = {(n, p.name) for n in masks.CATALOGUE for p in _keyword_params(n)}
    assert keywords == set(NON_DEFAULT)


@pytest.mark.parametrize("name,args", CATALOGUE_PARAMS)
def test_catalogue_prints_non_default_keywords(name, args):
    """Every catalogue call with each defaulted parameter set to another value prints it as
    ``name=value`` (the way the parser documents it) and reads back equal."""
    fn = masks.CATALOGUE[name]
    bound = inspect.signature(fn).bind(*args)
    for p in _keyword_params(name):
        bound.arguments[p.name] = NON_DEFAULT[(name, p.name)]
        m = fn(*bound.args, **bound.kwargs)
        text = roundtrip(m)
        value = "false" if NON_DEFAULT[(name, p.name)] is False else NON_DEFAULT[(name, p.name)]
        assert f", {p.name}={value})" in text, text
    if not _keyword_params(name):
        assert "=" not in roundtrip(fn(*args))


@FAST
@given(builtins)
def test_property_builtin_keywords_printed_unless_default(m):
    text = roundtrip(m)
    params = inspect.signature(masks.CATALOGUE[m.name]).parameters.values()
    for p, value in zip(params, m.args):
        if p.default is inspect.Parameter.empty:
            assert f"{p.name}=" not in text
        else:
            assert (f"{p.name}=" in text) == (value != p.default), text


@FAST
@given(rule_masks())
def test_property_rule_block_roundtrip(m):
    roundtrip(m)
    assert parse(to_text(m).replace("\n", " ;\n# comment\n")) == m


@FAST
@given(all_masks)
def test_property_any_mask_roundtrip(m):
    roundtrip(m)


def test_expressions_nested_too_deeply_raise_a_compile_mask_error():
    import compilemask as cm

    deep = cm.parse(" | ".join(f"sliding_window({i + 1})" for i in range(2000)))
    with pytest.raises(cm.CompileMaskError, match="nested too deeply"):
        cm.compile(deep, 64)
    with pytest.raises(cm.CompileMaskError, match="nested too deeply"):
        cm.parse("(" * 3000 + "causal()" + ")" * 3000)


def test_catalogue_integer_lists_checked_at_once_or_one_by_one():
    """Long plain-int lists take the one-pass check; anything else gets the per-item
    conversion and the message naming the item."""
    import numpy as np

    from compilemask import masks

    assert masks.document([16] * 3000).args[0] == (16,) * 3000
    assert masks.document([np.int64(3), 4]).args[0] == (3, 4)
    assert type(masks.document([np.int64(3), 4]).args[0][0]) is int
    for bad, message in (
        ([3, True], "lengths[1] must be an integer"),
        ([3, 0], "lengths[1] must be >= 1"),
        ([3, 4, 2**31], "lengths[2] must be below 2**31"),
        ([3, 2.0], "lengths[1] must be an integer"),
    ):
        with pytest.raises(CompileMaskError, match=re.escape(message)):
            masks.document(bad)
    assert str(masks.document([5, 7])) == "document([5, 7])"
