"""The two local tools of the small agent (agent.py, Week 4 Day 8): a calculator and a lookup in
the course's question-and-answer file. Each is an OpenAI tool (its JSON schema, every string
bounded so that even the tiny model, made to call it by a grammar, finishes the call) and a
function from the call's arguments to the text sent back as the `tool` message. A tool never
raises on its input: a bad expression or an empty query gets a result that says what is wrong.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .tiny_corpus import QA_FILE, parse_qa

MAX_EXPRESSION = 32  # characters of an expression
MAX_EXPONENT = 64  # |b| in a ** b
MAX_MAGNITUDE = 1e30  # |any number| met on the way
MAX_QUERY = 32
MAX_RESULT = 400  # characters of a result sent back to the model

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "pattern": f"^[0-9+*/(). -]{{1,{MAX_EXPRESSION}}}$",
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find the course's answer to a question about LLM serving.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [CALCULATOR, LOOKUP]

OPERATORS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (why, in a sentence)."""


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression: numbers, + - * / ** and parentheses, nothing
    else (no names, calls or attributes: the text is parsed with `ast`, never evaluated), every
    number and exponent bounded. CalculatorError otherwise."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    except ValueError as e:  # a NUL character
        raise CalculatorError(f"not an arithmetic expression: {e}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"an exponent above {MAX_EXPONENT} is too large")
        try:
            result = OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        return _bounded(result)
    raise CalculatorError(f"only numbers, + - * / ** and parentheses: not {type(node).__name__}")


def _bounded(value: float | int) -> float | int:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a number above {MAX_MAGNITUDE:g} is too large")
    return value


def calculator(expression: str) -> str:
    try:
        value = calculate(expression)
    except CalculatorError as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def lookup(query: str, qa_file: Path = QA_FILE) -> str:
    """The answer of the Q&A entry whose question shares the most words with the query."""
    words = _words(query)
    if not words:
        return "error: the query has no words to look up"
    best, best_score = None, 0
    for question, answer in parse_qa(Path(qa_file).read_text(encoding="utf-8")):
        score = len(words & _words(question))
        if score > best_score:
            best, best_score = answer, score
    if best is None:
        return f"nothing in the course's Q&A matches {query!r}"
    return best if len(best) <= MAX_RESULT else best[: MAX_RESULT - 3] + "..."


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}


FUNCTIONS: dict[str, Callable[..., str]] = {"calculator": calculator, "lookup": lookup}


def run_call(name: str, arguments: str) -> str:
    """A tool call's result: the function run on its arguments (a JSON object), or what is
    wrong with the call."""
    function = FUNCTIONS.get(name)
    if function is None:
        return f"error: there is no tool named {name!r}"
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    wanted = TOOLS[list(FUNCTIONS).index(name)]["function"]["parameters"]["required"]
    if not isinstance(args, dict) or set(args) != set(wanted):
        return f"error: {name} takes {', '.join(wanted)}"
    if not all(isinstance(v, str) for v in args.values()):
        return f"error: {name}'s arguments are strings"
    return function(**args)


def describe(arguments: Any) -> str:
    """A call's arguments, short, for the agent's printout."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return text if len(text) <= 80 else text[:77] + "..."
