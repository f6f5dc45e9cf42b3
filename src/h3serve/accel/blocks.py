"""How a model's repeated blocks run: every layer that changes it, in one declared order, installed in one place.

    body      per block class, the function run instead of its own `forward` (the fused passes: `accel.fused`)
    compiler  torch.compile of the body (`accel.compile.Compiler`), code shared by the instances of a class
    wrappers  per-block layers around the result, innermost first (the step cache: `accel.stepcache`); they wrap
              the DiT's main blocks (`model.blocks`)

`BlockStack.install` is the only code that sets a block's instance `forward`, always rebuilding it from the
declared layers, so the order of the calls that change a stack never matters and removing one layer keeps the
others. Each model carries its own stack (the attribute `block_stack`), so two models in one process never share
one. Without a stack (or an empty one) a block runs its own `forward`, the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from h3serve.model.dit import REPEATED_BLOCKS

ATTRIBUTE = "block_stack"


class Compiler(Protocol):
    """What the stack needs of a compiler (`accel.compile.Compiler`)."""

    def bind(self, block: nn.Module, body: Callable) -> Callable:
        """The compiled `body` as `block`'s forward."""
        ...


class BlockWrapper(Protocol):
    def wrap(self, index: int, block: nn.Module, inner: Callable) -> Callable:
        """The forward of `model.blocks[index]`, around `inner` (what runs beneath this layer)."""
        ...


@dataclass
class BlockStack:
    bodies: dict[type, Callable] = field(default_factory=dict)
    compiler: Compiler | None = None
    wrappers: list[BlockWrapper] = field(default_factory=list)

    @staticmethod
    def of(model: nn.Module) -> BlockStack:
        """`model`'s stack (made empty on first use)."""
        stack = model.__dict__.get(ATTRIBUTE)
        if stack is None:
            stack = BlockStack()
            model.__dict__[ATTRIBUTE] = stack
        return stack

    def set_body(self, cls: type, body: Callable | None) -> BlockStack:
        if body is None:
            self.bodies.pop(cls, None)
        else:
            self.bodies[cls] = body
        return self

    def set_compiler(self, compiler: Compiler | None) -> BlockStack:
        self.compiler = compiler
        return self

    def describe(self) -> str:
        """The layers, innermost first (for logs and tests)."""
        parts = [f"{cls.__name__}: {getattr(body, 'func', body).__name__}" for cls, body in self.bodies.items()]
        parts += ["compiled"] if self.compiler is not None else []
        parts += [type(w).__name__ for w in self.wrappers]
        return " -> ".join(parts) or "own forward"

    def install(self, model: nn.Module) -> BlockStack:
        """Set every repeated block's forward from the declared layers (the only place that does)."""
        blocks = [m for m in model.modules() if isinstance(m, REPEATED_BLOCKS)]
        main = getattr(model, "blocks", None)
        if not blocks and (self.bodies or self.compiler is not None):
            names = ", ".join(c.__name__ for c in REPEATED_BLOCKS)
            raise ValueError(f"{type(model).__name__} has no repeated blocks ({names})")
        for block in {*blocks, *(main or ())}:  # an earlier install's forwards (a wrapper's: blocks of any class)
            block.__dict__.pop("forward", None)
        for block in blocks:
            cls = type(block)
            body = self.bodies.get(cls)
            if self.compiler is not None:
                block.forward = self.compiler.bind(block, body or cls.forward)
            elif body is not None:
                block.forward = functools.partial(body, block)
        if self.wrappers:
            if main is None:
                raise ValueError(f"{type(model).__name__} has no `blocks` for the wrappers to wrap")
            for wrapper in self.wrappers:
                for i, block in enumerate(main):
                    block.forward = wrapper.wrap(i, block, block.forward)
        return self
