"""`ComfyMathExpression`'s formulas, evaluated by walking their syntax tree against a whitelist (never `eval`).

What a formula may hold, as ComfyUI documents the node: numbers and booleans; the node's values by their letters
`a`, `b`, `c`, ... and all of them as the list `values`; `+ - * / // % **`, unary `+ - not`, comparisons (chained),
`and` / `or`, `x if c else y`; and the functions `sum min max abs round pow sqrt ceil floor log log2 log10 sin cos
tan int float`. Anything else (attributes, subscripts, names outside the values, keyword arguments, lambdas, ...) is
refused naming what was found. Integers are bounded so a formula cannot ask for a number of a billion digits.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping, Sequence

from stagekit.errors import InvalidArgument

MAX_ABS_INT = 10**30     # far above any size, frame count or seed; bounds `**` and `*` on integers
MAX_EXPRESSION_CHARS = 2000
MAX_NODES = 500          # syntax-tree nodes in one formula

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_FUNCTIONS = {"sum": sum, "min": min, "max": max, "abs": abs, "round": round, "pow": pow, "sqrt": math.sqrt,
              "ceil": math.ceil, "floor": math.floor, "log": math.log, "log2": math.log2, "log10": math.log10,
              "sin": math.sin, "cos": math.cos, "tan": math.tan, "int": int, "float": float}


class ExpressionError(InvalidArgument):
    """A formula that is refused or cannot be evaluated; the message says which part and why."""


def evaluate(expression: str, values: Mapping[str, float | int | bool]) -> float | int:
    """The number `expression` stands for with `values` ({letter: number}); ExpressionError otherwise."""
    if not isinstance(expression, str) or not expression.strip():
        raise ExpressionError("the math expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the math expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"math expression {expression!r} is not valid: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ExpressionError(f"math expression {expression!r} is too long (more than {MAX_NODES} terms)")
    env = dict(values)
    env["values"] = list(values.values())
    try:
        result = _Evaluator(expression, env).visit(tree.body)
    except ExpressionError:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:
        raise ExpressionError(f"math expression {expression!r} cannot be evaluated: {e}") from None
    if isinstance(result, bool):
        result = int(result)
    if not isinstance(result, (int, float)) or isinstance(result, float) and not math.isfinite(result):
        raise ExpressionError(f"math expression {expression!r} gives {result!r}, not a finite number")
    return result


class _Evaluator(ast.NodeVisitor):
    def __init__(self, expression: str, env: dict):
        self.expression = expression
        self.env = env

    def refuse(self, node: ast.AST, what: str) -> ExpressionError:
        return ExpressionError(f"math expression {self.expression!r}: {what} is not allowed (numbers, the values "
                               "a, b, ..., arithmetic, comparisons and the listed functions only)")

    def generic_visit(self, node: ast.AST):
        raise self.refuse(node, type(node).__name__)

    @staticmethod
    def bounded(v):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_ABS_INT:
            raise ExpressionError(f"an intermediate result is above {MAX_ABS_INT:.0e}")
        return v

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, (bool, int, float)):
            return self.bounded(node.value)
        raise self.refuse(node, f"the constant {node.value!r}")

    def visit_Name(self, node: ast.Name):
        if node.id in self.env:
            return self.env[node.id]
        raise ExpressionError(f"math expression {self.expression!r} uses {node.id!r}, which is not one of its "
                              f"values ({', '.join(k for k in self.env if k != 'values') or 'none connected'})")

    def visit_List(self, node: ast.List):
        return [self.visit(e) for e in node.elts]

    visit_Tuple = visit_List

    def visit_BinOp(self, node: ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise self.refuse(node, f"the operator {type(node.op).__name__}")
        left, right = self.visit(node.left), self.visit(node.right)
        if op is operator.pow and isinstance(right, (int, float)) and abs(right) > 1024:
            raise ExpressionError(f"math expression {self.expression!r}: an exponent above 1024")
        return self.bounded(op(left, right))

    def visit_UnaryOp(self, node: ast.UnaryOp):
        v = self.visit(node.operand)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return +v
        if isinstance(node.op, ast.Not):
            return not v
        raise self.refuse(node, f"the operator {type(node.op).__name__}")

    def visit_BoolOp(self, node: ast.BoolOp):
        result = self.visit(node.values[0])
        for v in node.values[1:]:
            if isinstance(node.op, ast.And) and not result or isinstance(node.op, ast.Or) and result:
                break
            result = self.visit(v)
        return result

    def visit_Compare(self, node: ast.Compare):
        left = self.visit(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            fn = _COMPARE.get(type(op))
            if fn is None:
                raise self.refuse(node, f"the comparison {type(op).__name__}")
            right = self.visit(right_node)
            if not fn(left, right):
                return False
            left = right
        return True

    def visit_IfExp(self, node: ast.IfExp):
        return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)

    def visit_Call(self, node: ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            name = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise ExpressionError(f"math expression {self.expression!r} calls {name!r}; the functions are "
                                  f"{', '.join(_FUNCTIONS)}")
        if node.keywords:
            raise self.refuse(node, "a keyword argument")
        args: Sequence = [self.visit(a) for a in node.args]
        if node.func.id == "pow" and len(args) >= 2 and abs(args[1]) > 1024:
            raise ExpressionError(f"math expression {self.expression!r}: an exponent above 1024")
        return self.bounded(_FUNCTIONS[node.func.id](*args))
