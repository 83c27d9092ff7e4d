"""Scalar and list arguments of the Python builder API (the catalogue of ``compilemask.masks``,
``tile_grid`` and the layout builders): every constructor takes the same kinds of integers and
refuses the same things with a message naming the argument."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch

from compilemask import masks
from compilemask.errors import CompileMaskError
from compilemask.language.builders import grid, seg

# per constructor: valid arguments, and per argument its kind ("int": a scalar, "ints": a list
# of integers, "pair": a list of two) and whether negative values are refused
VALID = {
    "sliding_window": ((4,), {"window": ("int", True)}),
    "document": (([3, 5], True), {"lengths": ("ints", True)}),
    "prefix_lm": ((2,), {"prefix_len": ("int", True)}),
    "chunked": ((4,), {"chunk": ("int", True)}),
    "block_causal": ((4,), {"block": ("int", True)}),
    "shared_prompt": ((4, [2, 3]), {"prompt_len": ("int", True), "response_lens": ("ints", True)}),
    "hstu": (
        ([5, 6], [1, 2], 2),
        {"lengths": ("ints", True), "num_targets": ("ints", True), "contextual": ("int", True)},
    ),  # fmt: skip
    "clear": (
        ((4, 6), 2, 3),
        {"grid": ("pair", True), "radius": ("int", True), "text_len": ("int", True)},
    ),  # fmt: skip
    "global_local": ((2, [0, 5]), {"window": ("int", True), "global_tokens": ("ints", True)}),
    "tree": (([-1, 0, 0], 3), {"parents": ("ints", False), "prefix_len": ("int", True)}),
    "natten2d": (((5, 5), (3, 3)), {"grid": ("pair", True), "kernel": ("pair", True)}),
    "dilated": ((4, 2), {"window": ("int", True), "dilation": ("int", True)}),
}


def test_every_catalogue_constructor_with_arguments_is_listed():
    with_args = {n for n, f in masks.CATALOGUE.items() if inspect.signature(f).parameters}
    assert with_args == set(VALID)


def _cases():
    for name, (args, kinds) in VALID.items():
        params = list(inspect.signature(masks.CATALOGUE[name]).parameters)
        for arg, (kind, no_negative) in kinds.items():
            yield pytest.param(name, args, params.index(arg), arg, kind, no_negative,
                               id=f"{name}-{arg}")  # fmt: skip


def _with(args, i, value):
    return args[:i] + (value,) + args[i + 1 :]


def _int_forms(v):
    return [v, np.int64(v), np.int32(v), np.array(v), torch.tensor(v), torch.tensor(v).int()]


def _list_forms(vs):
    return [list(vs), tuple(vs), np.array(vs), np.array(vs, dtype=np.int32),
            torch.tensor(vs), torch.tensor(vs, dtype=torch.int32), [torch.tensor(v) for v in vs],
            [np.int64(v) for v in vs]]  # fmt: skip


def _refused(fn, args, arg, what=r"must"):
    with pytest.raises(CompileMaskError, match=rf"\b{re.escape(arg)}\b.*{what}") as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("name,args,i,arg,kind,no_negative", list(_cases()))
def test_integer_forms_accepted_and_the_rest_refused_by_name(name, args, i, arg, kind, no_negative):
    fn = masks.CATALOGUE[name]
    want = fn(*args)
    v = args[i]
    if kind == "int":
        for form in _int_forms(v):
            got = fn(*_with(args, i, form))
            assert got == want, type(form)
            assert all(type(a) is not torch.Tensor for a in got.args)
        bad = [
            float(v),
            np.float32(v),
            torch.tensor(float(v)),
            np.array(float(v)),
            True,
            np.bool_(True),
            torch.tensor(True),
            "4",
            None,
        ]
        if name != "shared_prompt":  # where a list of prompts is packed groups
            bad += [torch.tensor([v]), np.array([v])]
    else:
        for form in _list_forms(v):
            got = fn(*_with(args, i, form))
            assert got == want, type(form)
            assert str(got) == str(want)
        bad = [
            np.array(v, dtype=np.float64),
            torch.tensor(v, dtype=torch.float32),
            np.array(v, dtype=bool),
            torch.tensor(v).bool(),
            [float(x) for x in v],
            np.array([v]),
            torch.tensor([v]),
            torch.tensor(v[0]),
            np.array(v[0]),
            "1",
            3.5,
        ]
    for form in bad:
        _refused(fn, _with(args, i, form), arg)
    if no_negative:
        neg = -1 if kind == "int" else [-1] * len(v)
        for form in _int_forms(neg) if kind == "int" else _list_forms(neg):
            _refused(fn, _with(args, i, form), arg, ">=")


def test_messages_say_what_was_wrong():
    assert "2-D" in _refused(masks.document, (np.ones((2, 2), dtype=np.int64),), "lengths")
    assert "1-D" in _refused(masks.sliding_window, (torch.tensor([4]),), "window")
    assert "float" in _refused(masks.document, (torch.tensor([3.0, 5.0]),), "lengths")
    assert "bool" in _refused(masks.document, (np.array([True, True]),), "lengths")


def test_tile_grid_and_layout_builders_take_the_same_integers():
    inner = masks.clear((4, 6), 2, 3)
    want = masks.tile_grid(inner, (2, 3))
    for form in _list_forms([2, 3]):
        assert masks.tile_grid(inner, form) == want
    _refused(masks.tile_grid, (inner, np.array([2.0, 3.0])), "tile")
    assert seg("a", np.int64(5)) == seg("a", torch.tensor(5)) == seg("a", 5)
    for form in _list_forms([3, 5]):
        assert seg("doc", form) == seg("doc", [3, 5])
    assert grid("img", np.int64(2), torch.tensor(3)) == grid("img", 2, 3)
    for bad in (2.0, True, torch.tensor([2]), np.float64(2)):
        with pytest.raises(CompileMaskError, match="img"):
            grid("img", bad, 3)
    for bad in (2.0, True, torch.tensor(2.0), np.float64(2), np.bool_(True)):
        with pytest.raises(CompileMaskError, match="'a'"):
            seg("a", bad)
    with pytest.raises(CompileMaskError, match="'doc'"):
        seg("doc", np.array([[3, 5]]))
