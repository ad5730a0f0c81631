"""The `calculator` tool: exact arithmetic on rationals through Python's expression parser, never `eval`.

The expression is parsed with :func:`ast.parse` and only numbers, `+ - * / // % **` and parentheses are
evaluated, on :class:`fractions.Fraction` (decimal literals are read exactly: 0.1 is 1/10). Results are
integers, exact decimals when the denominator allows (1/8 -> 0.125), else a fraction with a 12-digit decimal
approximation. Sizes are bounded (input length, exponent, digits) so no expression can exhaust the host.
"""
from __future__ import annotations

import ast
from fractions import Fraction

from rlhf_mcore.agents.tools import Tool, register_tool

__all__ = ["CalculatorError", "evaluate", "format_number", "Calculator"]

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 4096
MAX_DIGITS = 2000


class CalculatorError(ValueError):
    """An expression the calculator does not accept; the message says why."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _check_size(x: Fraction) -> Fraction:
    if max(x.numerator.bit_length(), x.denominator.bit_length()) > MAX_DIGITS * 3.33:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return x


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        op = type(node.op)
        if op in _BINARY:
            return _check_size(_BINARY[op](a, b))
        if op in (ast.Div, ast.FloorDiv, ast.Mod):
            if b == 0:
                raise CalculatorError("division by zero")
            if op is ast.Div:
                return _check_size(a / b)
            return Fraction(a // b) if op is ast.FloorDiv else _check_size(a % b)
        if op is ast.Pow:
            if b.denominator != 1:
                raise CalculatorError("only integer exponents are supported")
            if abs(b.numerator) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {b.numerator} is out of range (|exponent| <= {MAX_EXPONENT})")
            if a == 0 and b < 0:
                raise CalculatorError("division by zero")
            bits = max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(b.numerator)
            if bits > MAX_DIGITS * 3.33:
                raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
            return a ** b.numerator
        raise CalculatorError(f"operator {op.__name__} is not supported (use + - * / // % **)")
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    elif isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    raise CalculatorError(f"{what} is not allowed: use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (module docstring), or CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg})") from None
    return _eval(tree)


def format_number(x: Fraction) -> str:
    """An integer, an exact decimal, or `p/q (≈ decimal)`."""
    if x.denominator == 1:
        return str(x.numerator)
    d, twos, fives = x.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d == 1:  # terminating decimal: scale to an integer
        places = max(twos, fives)
        scaled = abs(x.numerator) * 10 ** places // x.denominator
        digits = str(scaled).rjust(places + 1, "0")
        return ("-" if x < 0 else "") + digits[:-places] + "." + digits[-places:]
    return f"{x.numerator}/{x.denominator} (≈ {float(x):.12g})"


@register_tool()
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses)."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. 123456 * 654321"}},
                  "required": ["expression"]}

    def __call__(self, expression: str = None, **unexpected) -> str:
        if unexpected:
            raise CalculatorError(f"unexpected argument(s) {sorted(unexpected)}; the calculator takes "
                                  "'expression'")
        if expression is None:
            raise CalculatorError("missing argument 'expression'")
        return format_number(evaluate(str(expression) if isinstance(expression, (int, float)) else expression))
