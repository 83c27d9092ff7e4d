"""Parse mask text into the IR of :mod:`.ast` (hand-written lexer + recursive descent).

Grammar (EBNF; ``NL`` is a newline, ignored inside ``(...)`` and ``[...]``; ``#`` starts a
comment that runs to the end of the line)::

    text     = block | expr ;                      (* a bare block runs to the end *)
    expr     = term { ("|" | "-") term } ;         (* left associative *)
    term     = atom { "&" atom } ;                 (* "&" binds tighter than "|" and "-" *)
    atom     = "(" expr ")" | "{" block "}" | call
             | ("per_head" | "per_batch") "(" "[" expr { "," expr } [","] "]" ")" ;
    call     = NAME "(" [ arg { "," arg } [","] ] ")" ;   (* NAME in masks.CATALOGUE *)
    arg      = [ NAME "=" ] value ;
    value    = ["-"] INT | "true" | "false" | "[" [values] "]" | "(" [values] ")" ;
    block    = "layout" { segment [","] } { sep } [ rule { sep { sep } rule } ] { sep } ;
    sep      = NL | ";" ;
    segment  = NAME ":" ( INT | INT "x" INT | "[" INT { "," INT } "]" | "*"
                        | "grid" "(" INT "," INT ")" ) ;
    rule     = span "->" span ":" relation ;
    span     = ( "*" | NAME ) { "|" ( "*" | NAME ) } [ "[" ( NAME | INT ) "]" ] ;
    relation = NAME [ "(" [ ["-"] INT { "," ["-"] INT } ] ")" ] ;   (* NAME in RELATION_ARITY *)

Example::

    >>> from compilemask.language.parser import parse
    >>> m = parse('''
    ... layout prompt:4 resp:2x3
    ... prompt  -> prompt  : causal
    ... resp[i] -> prompt  : full
    ... resp[i] -> resp[i] : causal
    ... ''')
    >>> m.layout[1]
    Segment(name='resp', lengths=(3, 3), grid=None)
    >>> parse("document([3, 5], causal=false) | sliding_window(2)").op
    '|'

Errors: :class:`~compilemask.errors.MaskSyntaxError` (line, column, caret) for text that does not
parse; a layout the parser reads but :func:`.resolve.check_rules` rejects raises
:class:`~compilemask.errors.LayoutError`, and bad catalogue arguments the constructor's
:class:`~compilemask.errors.CompileMaskError`, both with the location appended.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from dataclasses import dataclass

from ..errors import (
    CompileMaskError,
    InputError,
    LayoutError,
    LengthError,
    MaskSyntaxError,
    too_deep,
)
from .ast import RELATION_ARITY, Combine, Mask, Relation, Rule, RuleMask, Segment, Span
from .resolve import check_layout, check_rules

__all__ = ["parse", "parse_layout", "parse_rule", "parse_span", "parse_relation"]

LIST_MASKS = ("per_head", "per_batch")
MAX_PARTS = 2**24  # parts of one family written KxL (documents, users, responses)

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\f\v]+) | (?P<comment>\#[^\n]*) | (?P<nl>\n)
    | (?P<rep>\d+x\d+(?![A-Za-z0-9_]))
    | (?P<int>\d+(?![A-Za-z0-9_]))
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>->|[-:|&()\[\]{},;*=])
    """,
    re.VERBOSE,
)
_OPEN = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class _Tok:
    kind: str  # "name", "int", "rep", "op", "nl", "eof"
    value: str
    pos: int

    def __str__(self) -> str:
        return {"nl": "end of line", "eof": "end of text"}.get(self.kind, repr(self.value))


def _tokenize(text: str) -> list[_Tok]:
    """Split ``text`` into tokens. Newlines are kept only outside ``(...)`` and ``[...]``."""
    toks: list[_Tok] = []
    stack: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            ch = text[pos]
            if ch.isdigit():
                raise MaskSyntaxError("bad number (a digit run followed by letters)", text, pos)
            raise MaskSyntaxError(f"unexpected character {ch!r}", text, pos)
        kind, value = m.lastgroup, m.group()
        if kind == "nl":
            if not stack or stack[-1] == "{":
                toks.append(_Tok("nl", value, pos))
        elif kind != "ws" and kind != "comment":
            toks.append(_Tok(kind, value, pos))
            if value in _OPEN and kind == "op":
                stack.append(value)
            elif kind == "op" and value in ")]}" and stack:
                stack.pop()
        pos = m.end()
    toks.append(_Tok("eof", "", len(text)))
    return toks


def _located(message: str, text: str, pos: int) -> str:
    """``message`` with the line, column and caret of ``pos`` (as MaskSyntaxError shows them)."""
    return str(MaskSyntaxError(message, text, pos))


def _reraise(err: CompileMaskError, text: str, pos: int) -> CompileMaskError:
    """The same error type with the location appended (MaskSyntaxError passes through)."""
    if isinstance(err, MaskSyntaxError):
        return err
    plain = (CompileMaskError, LayoutError, LengthError, InputError)  # one-message classes
    cls = type(err) if type(err) in plain else CompileMaskError
    new = cls(_located(str(err), text, pos))
    new.__cause__ = err
    return new


def _signature(name: str, fn) -> str:
    """``document(lengths, causal=true)``: a catalogue signature in the text syntax."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            default = str(p.default).lower() if isinstance(p.default, bool) else p.default
            parts.append(f"{p.name}={default}")
    return f"{name}({', '.join(parts)})"


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"known: {', '.join(sorted(known))}{hint}"


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    # -- token helpers -------------------------------------------------------------------------
    def peek(self) -> _Tok:
        return self.toks[self.i]

    def next(self) -> _Tok:
        tok = self.toks[self.i]
        if tok.kind != "eof":
            self.i += 1
        return tok

    def is_op(self, *values: str) -> bool:
        tok = self.peek()
        return tok.kind == "op" and tok.value in values

    def skip_nl(self) -> None:
        while self.peek().kind == "nl":
            self.i += 1

    def error(self, message: str, tok: _Tok | None = None) -> MaskSyntaxError:
        tok = tok or self.peek()
        return MaskSyntaxError(message, self.text, tok.pos)

    def expect_op(self, value: str, context: str) -> _Tok:
        if not self.is_op(value):
            raise self.error(f"expected {value!r} {context}, found {self.peek()}")
        return self.next()

    def expect_int(self, context: str, signed: bool = False) -> int:
        sign = 1
        if signed and self.is_op("-"):
            self.next()
            sign = -1
        tok = self.peek()
        if tok.kind != "int":
            raise self.error(f"expected an integer {context}, found {tok}")
        self.next()
        return sign * int(tok.value)

    def expect_name(self, context: str) -> _Tok:
        tok = self.peek()
        if tok.kind != "name":
            raise self.error(f"expected a name {context}, found {tok}")
        return self.next()

    def expect_end(self, context: str) -> None:
        self.skip_nl()
        if self.peek().kind != "eof":
            raise self.error(f"unexpected {self.peek()} {context}")

    # -- expressions ---------------------------------------------------------------------------
    def text_(self) -> Mask:
        self.skip_nl()
        tok = self.peek()
        if tok.kind == "name" and tok.value == "layout":
            mask = self.block(closing=None)
        else:
            mask = self.expr()
        self.expect_end("after the mask (expected an operator '|', '&' or '-')")
        return mask

    def expr(self) -> Mask:
        left = self.term()
        while True:
            self.skip_nl()
            if not self.is_op("|", "-"):
                return left
            op = self.next().value
            self.skip_nl()
            left = Combine(op, left, self.term())

    def term(self) -> Mask:
        left = self.atom()
        while True:
            self.skip_nl()
            if not self.is_op("&"):
                return left
            self.next()
            self.skip_nl()
            left = Combine("&", left, self.atom())

    def atom(self) -> Mask:
        self.skip_nl()
        tok = self.peek()
        if self.is_op("("):
            self.next()
            inner = self.expr()
            self.skip_nl()
            self.expect_op(")", "to close '('")
            return inner
        if self.is_op("{"):
            self.next()
            self.skip_nl()
            if not (self.peek().kind == "name" and self.peek().value == "layout"):
                raise self.error(f"expected 'layout' after '{{', found {self.peek()}")
            return self.block(closing="}")
        if tok.kind != "name":
            raise self.error(
                f"expected a mask (a call such as causal(), or '{{', or '('), found {tok}"
            )
        if tok.value == "layout":
            raise self.error(
                "a rule block inside an expression is written in braces: { layout ...; rule; ... }"
            )
        if tok.value in LIST_MASKS:
            return self.list_mask()
        if tok.value == "tile_grid":
            return self.tile_grid()
        return self.call()

    def tile_grid(self) -> Mask:
        from .. import masks

        name = self.next()
        self.expect_op("(", "after 'tile_grid'")
        inner = self.expr()
        args = []
        if self.is_op(","):
            self.next()
            args.append(self.value())
        self.expect_op(")", "to close tile_grid(...)")
        try:
            return masks.tile_grid(inner, *args)
        except CompileMaskError as err:
            raise _reraise(err, self.text, name.pos) from None

    def list_mask(self) -> Mask:
        from .. import masks

        name = self.next()
        self.expect_op("(", f"after {name.value!r}")
        self.expect_op("[", f"in {name.value}([...]) (it takes a list of masks)")
        items = []
        while not self.is_op("]"):
            items.append(self.expr())
            if not self.is_op(","):
                break
            self.next()
        self.expect_op("]", f"to close the list of {name.value}")
        self.expect_op(")", f"to close {name.value}(...)")
        try:
            return getattr(masks, name.value)(items)
        except CompileMaskError as err:
            raise _reraise(err, self.text, name.pos) from None

    def call(self) -> Mask:
        from ..masks import CATALOGUE

        name = self.next()
        if name.value not in CATALOGUE:
            known = set(CATALOGUE) | set(LIST_MASKS) | {"tile_grid"}
            raise self.error(
                f"unknown mask {name.value!r}; {_did_you_mean(name.value, known)}", name
            )
        if not self.is_op("("):
            raise self.error(
                f"expected '(' after {name.value!r} (masks are called: "
                f"{name.value}(...)), found {self.peek()}"
            )
        self.next()
        args: list = []
        kwargs: dict = {}
        while not self.is_op(")"):
            tok = self.peek()
            if (
                tok.kind == "name"
                and self.toks[self.i + 1].value == "="
                and tok.value not in ("true", "false")
            ):
                self.i += 2
                if tok.value in kwargs:
                    raise self.error(f"argument {tok.value!r} is given twice", tok)
                kwargs[tok.value] = self.value()
            elif kwargs:
                raise self.error("a positional argument follows a keyword argument")
            else:
                args.append(self.value())
            if not self.is_op(","):
                break
            self.next()
        self.expect_op(")", f"to close {name.value}(...)")
        fn = CATALOGUE[name.value]
        signature = inspect.signature(fn)
        unknown = [kw for kw in kwargs if kw not in signature.parameters]
        if unknown:  # before binding: a misspelt keyword, not the argument it left out
            sig = _signature(name.value, fn)
            raise self.error(
                f"bad arguments for {sig}: unexpected keyword {unknown[0]!r}", name
            ) from None
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            sig = _signature(name.value, fn)
            raise self.error(f"bad arguments for {sig}: {err}", name) from None
        try:
            return fn(*args, **kwargs)
        except CompileMaskError as err:
            raise _reraise(err, self.text, name.pos) from None

    def value(self):
        tok = self.peek()
        if tok.kind == "int" or self.is_op("-"):
            return self.expect_int("", signed=True)
        if tok.kind == "name" and tok.value in ("true", "false"):
            self.next()
            return tok.value == "true"
        if self.is_op("[", "("):
            close = _OPEN[self.next().value]
            items = []
            while not self.is_op(close):
                items.append(self.value())
                if not self.is_op(","):
                    break
                self.next()
            self.expect_op(close, "to close the list")
            return items if close == "]" else tuple(items)
        raise self.error(f"expected a value (an integer, true, false or a list), found {tok}")

    # -- rule blocks ---------------------------------------------------------------------------
    def at_block_end(self, closing: str | None) -> bool:
        tok = self.peek()
        return tok.kind == "eof" if closing is None else self.is_op(closing)

    def at_sep(self) -> bool:
        return self.peek().kind == "nl" or self.is_op(";")

    def block(self, closing: str | None) -> RuleMask:
        self.next()  # "layout"
        layout = self.layout(closing)
        rules = []
        while True:
            while self.at_sep():
                self.next()
            if self.at_block_end(closing):
                break
            if self.peek().kind == "eof":
                raise self.error("expected '}' to close the rule block, found end of text")
            start = self.peek()
            rule = self.rule()
            try:
                check_rules(RuleMask(layout, (rule,)))
            except CompileMaskError as err:
                raise _reraise(err, self.text, start.pos) from None
            rules.append(rule)
            if not (self.at_sep() or self.at_block_end(closing) or self.peek().kind == "eof"):
                raise self.error(f"expected a new line or ';' after a rule, found {self.peek()}")
        if closing is not None:
            self.next()
        return RuleMask(layout, tuple(rules))

    def layout(self, closing: str | None) -> tuple[Segment, ...]:
        segments: list[Segment] = []
        while not (self.at_sep() or self.at_block_end(closing) or self.peek().kind == "eof"):
            start = self.peek()
            segments.append(self.segment())
            try:
                check_layout(tuple(segments))
            except CompileMaskError as err:
                raise _reraise(err, self.text, start.pos) from None
            if self.is_op(","):
                self.next()
        return tuple(segments)

    def segment(self) -> Segment:
        name = self.expect_name("for a layout segment (name:length)").value
        self.expect_op(":", f"after segment name {name!r} (write {name}:LENGTH)")
        tok = self.peek()
        if tok.kind == "int":
            return Segment(name, (self.expect_int(""),))
        if tok.kind == "rep":
            count, length = (int(v) for v in tok.value.split("x"))
            if not 1 <= count <= MAX_PARTS or count * length > 2**31 - 1:
                raise self.error(
                    f"{name}:{tok.value}: a family holds 1 to {MAX_PARTS} parts and at most "
                    "2**31 - 1 tokens",
                    tok,
                )
            self.next()
            return Segment(name, (length,) * count)
        if self.is_op("*"):
            self.next()
            return Segment(name, None)
        if self.is_op("["):
            self.next()
            lengths = [self.expect_int(f"in the lengths of {name!r}")]
            while self.is_op(","):
                self.next()
                if self.is_op("]"):
                    break
                lengths.append(self.expect_int(f"in the lengths of {name!r}"))
            self.expect_op("]", f"to close the lengths of {name!r}")
            return Segment(name, tuple(lengths))
        if tok.kind == "name" and tok.value == "grid":
            self.next()
            self.expect_op("(", "after 'grid'")
            h = self.expect_int("(grid height)")
            self.expect_op(",", "between grid height and width")
            w = self.expect_int("(grid width)")
            self.expect_op(")", "to close grid(h, w)")
            return Segment(name, (h * w,), (h, w))
        raise self.error(
            f"expected a length for segment {name!r} (LENGTH, KxLENGTH, [l1, l2, ...], *, "
            f"or grid(h, w)), found {tok}"
        )

    def rule(self) -> Rule:
        query = self.span("query")
        self.expect_op("->", "after the query span")
        key = self.span("key")
        self.expect_op(":", "after the key span (write QUERY -> KEY : RELATION)")
        return Rule(query, key, self.relation())

    def span(self, role: str) -> Span:
        names = [self.span_name(role)]
        while self.is_op("|"):
            self.next()
            names.append(self.span_name(role))
        index: str | int | None = None
        if self.is_op("["):
            self.next()
            tok = self.peek()
            if tok.kind == "int":
                index = int(self.next().value)
            elif tok.kind == "name":
                index = self.next().value
            else:
                raise self.error(f"expected an index variable or a part number, found {tok}")
            self.expect_op("]", "to close the index")
        return Span(tuple(names), index)

    def span_name(self, role: str) -> str:
        if self.is_op("*"):
            self.next()
            return "*"
        return self.expect_name(f"or '*' for the {role} span").value

    def relation(self) -> Relation:
        tok = self.expect_name("for the relation (full, causal, band(lo, hi), ...)")
        kind = tok.value
        if kind not in RELATION_ARITY:
            raise self.error(
                f"unknown relation {kind!r}; {_did_you_mean(kind, RELATION_ARITY)}", tok
            )
        params: list[int] = []
        if self.is_op("("):
            self.next()
            while not self.is_op(")"):
                params.append(self.expect_int(f"in {kind}(...)", signed=True))
                if not self.is_op(","):
                    break
                self.next()
            self.expect_op(")", f"to close {kind}(...)")
        arity = RELATION_ARITY[kind]
        if len(params) != arity:
            raise self.error(
                f"relation {kind!r} takes {arity} parameter(s), got {len(params)}", tok
            )
        return Relation(kind, tuple(params))


@too_deep
def parse(text: str) -> Mask:
    """Parse mask text (an expression, or a bare rule block starting with ``layout``).

    Args:
        text: the mask in the region language (grammar in this module's docstring).

    Returns:
        The mask IR (:class:`~.ast.RuleMask`, :class:`~.ast.Builtin`, :class:`~.ast.Combine`,
        :class:`~.ast.PerHead` or :class:`~.ast.PerBatch`); ``parse(str(m)) == m``.

    Raises:
        MaskSyntaxError: the text does not parse (the message shows line, column and a caret).
        LayoutError: a rule block is inconsistent (duplicate segment, unknown span, ...).
        CompileMaskError: a catalogue call has bad arguments.

    Example::

        >>> parse("layout a:4 b:2\\na|b -> a : band(-1, 0)").rules[0].relation
        Relation(kind='band', params=(-1, 0))
        >>> str(parse("causal() & (sliding_window(8) | prefix_lm(2))"))
        'causal() & (sliding_window(8) | prefix_lm(2))'
    """
    if not isinstance(text, str):
        raise CompileMaskError(f"parse() needs a str, got {type(text).__name__}")
    return _parse_cached(text)


@functools.lru_cache(maxsize=256)
def _parse_cached(text: str) -> Mask:
    return _Parser(text).text_()


def _parse_part(text: str, method: str, what: str, *args):
    p = _Parser(text)
    p.skip_nl()
    out = getattr(p, method)(*args)
    p.expect_end(f"after the {what}")
    return out


def parse_span(text: str) -> Span:
    """Parse one span: ``"prompt"``, ``"a|b"``, ``"*"``, ``"resp[i]"``, ``"resp[2]"``.

    Example::

        >>> parse_span("resp[i]")
        Span(names=('resp',), index='i')
    """
    return _parse_part(text, "span", "span", "query")


def parse_relation(text: str) -> Relation:
    """Parse one relation: ``"causal"``, ``"band(-128, 0)"``, ``"disc(16)"``, ...

    Example::

        >>> parse_relation("band(-128, 0)")
        Relation(kind='band', params=(-128, 0))
    """
    return _parse_part(text, "relation", "relation")


def parse_rule(text: str) -> Rule:
    """Parse one rule ``"QUERY -> KEY : RELATION"`` (not checked against a layout).

    Example::

        >>> parse_rule("resp[i] -> prompt : full").key
        Span(names=('prompt',), index=None)
    """
    return _parse_part(text, "rule", "rule")


def parse_layout(text: str) -> tuple[Segment, ...]:
    """Parse the segments of a layout (with or without the leading ``layout`` keyword).

    Example::

        >>> [(s.name, s.lengths, s.grid) for s in parse_layout("prompt:4 resp:2x3 img:grid(2,3)")]
        [('prompt', (4,), None), ('resp', (3, 3), None), ('img', (6,), (2, 3))]
    """
    p = _Parser(text)
    p.skip_nl()
    if p.peek().kind == "name" and p.peek().value == "layout" and p.toks[p.i + 1].value != ":":
        p.next()
    out = p.layout(None)
    p.expect_end("after the layout")
    return out
