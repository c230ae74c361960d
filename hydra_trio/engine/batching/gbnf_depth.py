"""How deep llama.cpp's grammar engine nests its stacks for a GBNF grammar, read from the text.

llama.cpp's grammar engine (``src/llama-grammar.cpp`` of the llama.cpp that llama-cpp-python 0.3.36
vendors) keeps, for each way the text may go on, a stack of the places to return to: a reference
to a rule (or a group, or a repeated item: llama.cpp makes rules of those) that is not the last item
of its alternative pushes one.  Each step copies stacks whole and remembers every stack it has seen,
so a chain of N such references (``r0 ::= r1 "x"``, ``r1 ::= r2 "x"``, ...) costs time and memory
in N squared before the first token: 10,000 of them (200 KB of text) took 2.5 s and 630 MiB.  And its
check for left recursion follows any chain of references with one C call per link: 18,000 links
(``a0 ::= a1``, ...) overflowed a 2 MiB thread stack.

:func:`depths` finds the longest such chains with one linear pass over the text and the rule
graph (no recursion: rules can be many).  Recursion through the grammar (a rule that reaches itself)
counts nothing: each round of it needs generated text, whose length the request bounds.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<literal>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<tok>!?<[^>]*>)
  | (?P<define>::=)
  | (?P<name>[a-zA-Z0-9_-]+)
  | (?P<rep>\{[^}]*\})
  | (?P<op>[()|*+?.])
""",
    re.VERBOSE | re.DOTALL,
)


def _tokens(grammar: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    while pos < len(grammar):
        m = _TOKEN.match(grammar, pos)
        if m is None:  # llama.cpp's parser says what is wrong with it
            break
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group()))
    return out


def _edges(grammar: str) -> dict[str, list[tuple[str, int]]]:
    """``{node: [(node it references, stack entries the reference pushes)]}``; nodes are rule names
    and ``(n)`` for the n-th group."""
    toks = _tokens(grammar)
    edges: dict[str, list[tuple[str, int]]] = {}
    groups = 0
    # a rule starts at NAME ::=, its body runs to the next one
    starts = [i for i in range(len(toks) - 1) if toks[i][0] == "name" and toks[i + 1][0] == "define"]
    for k, start in enumerate(starts):
        body = toks[start + 2 : starts[k + 1] if k + 1 < len(starts) else len(toks)]
        # (node, item being read: (target or None, repeated), items of the alternative so far)
        stack: list[tuple[str, list[tuple[str | None, bool]]]] = [(toks[start][1], [])]
        edges.setdefault(toks[start][1], [])

        def close_alternative(node: str, items: list[tuple[str | None, bool]]) -> None:
            for i, (target, repeated) in enumerate(items):
                if target is not None:
                    edges[node].append((target, (i < len(items) - 1) + repeated))

        for kind, text in body:
            node, items = stack[-1]
            if kind == "name":
                items.append((text, False))
            elif kind in ("literal", "cls", "tok") or text == ".":
                items.append((None, False))
            elif kind == "rep" or text in "*+?":
                if items and text != "?":
                    items[-1] = (items[-1][0], True)
            elif text == "|":
                close_alternative(node, items)
                stack[-1] = (node, [])
            elif text == "(":
                group = f"({groups})"
                groups += 1
                edges[group] = []
                items.append((group, False))
                stack.append((group, []))
            elif text == ")" and len(stack) > 1:
                close_alternative(node, items)
                stack.pop()
        while stack:
            close_alternative(*stack.pop())
    return edges


def depths(grammar: str) -> tuple[int, int]:
    """``(stack depth, reference chain)`` of ``grammar``, recursion not counted (this module's docstring):
    the most stack entries a chain of references pushes, and the longest chain of references, which
    llama.cpp's check for left recursion (``llama_grammar_detect_left_recursion``) follows with one C
    call per link, about 140 bytes of a thread's stack each.  Linear in the grammar's text."""
    edges = _edges(grammar)
    # Tarjan's strongly connected components, without recursion; they come out callees first
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    component: dict[str, int] = {}
    on_stack: set[str] = set()
    scc_stack: list[str] = []
    order: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                scc_stack.append(node)
                on_stack.add(node)
            out = edges[node]
            if i < len(out):
                work.append((node, i + 1))
                target = out[i][0]
                if target not in edges:
                    continue
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            for target, _ in out:
                if target in on_stack:
                    low[node] = min(low[node], low[target])
            if low[node] == index[node]:
                members = []
                while True:
                    m = scc_stack.pop()
                    on_stack.discard(m)
                    component[m] = len(order)
                    members.append(m)
                    if m == node:
                        break
                order.append(members)
    # the longest chains, callees first; edges inside a component (recursion) count nothing
    stack = [0] * len(order)
    chain = [0] * len(order)
    for c, members in enumerate(order):
        for node in members:
            for target, pushes in edges[node]:
                t = component.get(target)
                if t is not None and t != c:
                    stack[c] = max(stack[c], pushes + stack[t])
                    chain[c] = max(chain[c], 1 + chain[t])
    return max(stack, default=0), max(chain, default=0)


def stack_depth(grammar: str) -> int:
    """The first of :func:`depths`."""
    return depths(grammar)[0]
