"""What a chat template reads, found from its syntax tree the way vLLM 0.32 finds it (``renderers/hf.py``).

Two facts decide how vLLM hands a conversation to a template, and so which tokens it renders:

- **the content format.** A template that loops over a message's content gets every message's content as a
  list of ``{"type": "text", "text": ...}`` parts ("openai"), even content sent as a plain string; any other
  template gets one string ("string"). vLLM decides by looking for such a loop: over ``<message>.content``
  where ``<message>`` is the loop variable of a loop over ``messages`` (or a variable set from it, a slice
  of it, or either through a filter or a test); over a macro parameter that some call passes such a
  content; or over a variable named ``content`` outside any macro. A template it cannot parse is "string".
- **the variables it reads.** Of a request's ``chat_template_kwargs`` vLLM passes on only the keys the
  template reads from outside (Jinja's undeclared variables) and the parameters of transformers'
  ``apply_chat_template`` itself; the rest are dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2.meta
from jinja2 import nodes

ContentFormat = Literal["string", "openai"]


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    try:
        tree = _parse(template)
        return "openai" if any(_content_loops(tree)) else "string"
    except Exception:  # vLLM falls back to "string" on any template it cannot read
        return "string"


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The names the template reads without setting them (``messages``, ``add_generation_prompt``, ...)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_parse(template)))


def _parse(template: str) -> nodes.Template:
    # transformers' own environment: it knows the {% generation %} tag that some templates use
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tree: nodes.Template = _compile_jinja_template(template).environment.parse(template)
    return tree


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    message_names = set(_message_names(tree))
    loops_in_macros = {id(loop) for macro in tree.find_all(nodes.Macro) for loop in macro.find_all(nodes.For)}
    content_params = _macro_content_params(tree, message_names)
    for loop in tree.find_all(nodes.For):
        if (
            _reads_content(loop.iter, message_names)
            or (isinstance(loop.iter, nodes.Name) and loop.iter.name in content_params.get(id(loop), ()))
            or (_loads(loop.iter, "content") and id(loop) not in loops_in_macros)
        ):
            _target_name(loop.target)  # as vLLM, which gives up when the first such loop binds a tuple
            yield loop


def _message_names(tree: nodes.Template) -> Iterator[str]:
    """The loop variables of loops over ``messages`` or any variable set from it."""
    conversations = _names_set_from(tree, "messages")
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, name) for name in conversations):
            yield _target_name(loop.target)


def _names_set_from(tree: nodes.Template, root: str) -> set[str]:
    """``root`` and every variable ``{% set %}`` from it (or from one of those), whole or sliced."""
    found, pending = {root}, [root]
    while pending:
        source = pending.pop()
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, source):
                name = _target_name(assign.target)
                if name not in found:
                    found.add(name)
                    pending.append(name)
    return found


def _macro_content_params(tree: nodes.Template, message_names: set[str]) -> dict[int, set[str]]:
    """For each loop inside a macro: the macro's parameters that some call passes a message's content."""
    by_loop: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            passed = [(params[i], arg) for i, arg in enumerate(call.args) if i < len(params)]
            passed += [(kw.key, kw.value) for kw in call.kwargs if kw.key in params]
            bound |= {param for param, value in passed if _reads_content(value, message_names)}
        if bound:
            by_loop |= {id(loop): bound for loop in macro.find_all(nodes.For)}
    return by_loop


def _reads_content(node: nodes.Node, message_names: set[str]) -> bool:
    return any(_reads(node, name, "content") for name in message_names)


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``name`` (or ``name.key``, ``name['key']``), maybe sliced, filtered or tested."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _loads(node, name)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _loads(node.node, name)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _loads(node.node, name)
    return False


def _loads(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _target_name(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):  # vLLM gives up on such a template ("string")
        raise TypeError(f"a loop or set over the conversation binds {type(target).__name__}, not a name")
    return target.name
